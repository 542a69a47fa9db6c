#!/usr/bin/env python
"""What running the estimate in an isolated worker costs, beside running it in the caller's process.

    .venv/bin/python bench/isolation_latency.py [--warm 5] [--out bench/results/isolation-latency.json]

Per workload (gpt2-small, resnet18, tiny-gpt2) and hardware (h100-sxm, cpu), batch 8, calibrate=False, three
fresh processes, each with a fresh ADVISOR_DATA_DIR (so no measured peak or calibration of another run takes part):
- cold in process: the time to import torch and the advisor, then the first `estimate_memory`;
- isolated: the advisor's imports (torch is the worker's), the first `advisor.isolation.estimate` (it starts the
  fork server and the worker), one in-process estimate and one more isolated, then --warm more of each in turn
  (ABBA): the warm figures are their medians, in wall seconds and in CPU seconds of the process tree, and the
  isolated calls' time outside the estimator's own timer (transport and the worker's bookkeeping);
- isolated after another workload (the API's case): the worker estimates the next workload first, then this one
  and that in turn: this workload's first call (new to the warm worker), and the median of its later ones.
The overhead is isolated warm minus in-process warm; the goal is at most GOAL_S. Every call's figures go to --out
(JSON) and the table to the markdown beside it; bench/compose_benchmarks.py puts that in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WORKLOADS = ("gpt2-small", "resnet18", "tiny-gpt2")
HARDWARE = ("h100-sxm", "cpu")
BATCH = 8
GOAL_S = 0.5  # warm isolated minus warm in-process, per estimate
MIXED = 3  # this workload's calls in the mixed run, each after the other workload's
CHILD_TIMEOUT_S = 600.0


def _tree(root: int) -> tuple[float, list[int]]:
    """CPU seconds of process `root` and every process below it (the fork server and its workers), their reaped
    children's included, and those processes' pids (from /proc)."""
    parent, spent = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # state, ppid, ..., utime (11), stime, cutime, cstime
        except OSError:
            continue  # exited while we looked
        parent[int(entry)] = int(fields[1])
        spent[int(entry)] = sum(int(x) for x in fields[11:15])
    ticks, pids = 0, []
    for pid, cpu in spent.items():
        up = pid
        while up not in (root, 0, 1) and up in parent:
            up = parent[up]
        if up == root:
            ticks, pids = ticks + cpu, pids + [pid]
    return ticks / os.sysconf("SC_CLK_TCK"), sorted(pids)


def child(payload: dict[str, Any]) -> dict[str, Any]:
    """In this fresh process: the imports payload['imports'] names, then each (mode, workload, hardware) of
    payload['calls'] timed, `estimate_memory` here (mode 'in_process') or `advisor.isolation.estimate`."""
    t0 = time.perf_counter()
    if "torch" in payload["imports"]:
        import torch  # noqa: F401 - timed: the in-process estimate needs it

    t1 = time.perf_counter()
    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory

    if any(mode == "isolated" for mode, _, _ in payload["calls"]):
        from advisor.isolation import estimate as isolated
    t2 = time.perf_counter()
    calls = []
    for mode, workload, hardware in payload["calls"]:
        run = isolated if mode == "isolated" else estimate_memory
        torch_before, (cpu, _) = "torch" in sys.modules, _tree(os.getpid())
        start = time.perf_counter()
        est = run(workload, hardware, EstimateRequest.of(payload["batch"]), EstimateOptions(calibrate=False))
        wall = time.perf_counter() - start
        cpu_after, pids = _tree(os.getpid())
        calls.append({"mode": mode, "workload": workload, "wall_s": wall, "estimate_s": est.seconds,
                      "cpu_s": cpu_after - cpu, "processes": pids, "torch_in_caller_before": torch_before,
                      "total_bytes": est.total_bytes})
    return {"torch_import_s": t1 - t0, "advisor_import_s": t2 - t1, "calls": calls}


def _fresh_child(payload: dict[str, Any]) -> dict[str, Any]:
    """`child(payload)` in a fresh process with a fresh ADVISOR_DATA_DIR, removed after."""
    from bench.estimate_accuracy import _child, _load_avg

    data = tempfile.mkdtemp(prefix="iso-lat-")
    before, os.environ["ADVISOR_DATA_DIR"] = os.environ.get("ADVISOR_DATA_DIR"), data
    load = _load_avg()
    try:
        out = _child("run", payload, CHILD_TIMEOUT_S, script=Path(__file__).resolve())
    finally:
        if before is None:
            os.environ.pop("ADVISOR_DATA_DIR", None)
        else:
            os.environ["ADVISOR_DATA_DIR"] = before
        shutil.rmtree(data, ignore_errors=True)
    return {**out, "load_avg_before": load, "load_avg_after": _load_avg()}


def _median(calls: list[dict[str, Any]], key: str = "wall_s") -> float:
    return statistics.median(c[key] for c in calls)


def measure(workload: str, hardware: str, other: str, warm: int) -> dict[str, Any]:
    """One workload on one hardware: three fresh processes' calls and the figures drawn from them.
    Warm in-process and isolated calls alternate in one process (ABBA), so both see the same load."""
    inp, iso, w, o = ("in_process", workload, hardware), ("isolated", workload, hardware), workload, other
    pairs = [x for i in range(warm) for x in ((iso, inp) if i % 2 == 0 else (inp, iso))]
    cold = _fresh_child({"imports": "torch advisor", "calls": [inp], "batch": BATCH})
    # The first in-process estimate sets TORCHINDUCTOR_CACHE_DIR (torch's inductor does), and the pool replaces a
    # worker started in another environment: one isolated call after it takes that new worker's start.
    paired = _fresh_child({"imports": "advisor", "calls": [iso, inp, iso, *pairs], "batch": BATCH})
    mixed = [("isolated", o, hardware)] + [("isolated", w, hardware), ("isolated", o, hardware)] * MIXED
    mix = _fresh_child({"imports": "advisor", "calls": mixed[:-1], "batch": BATCH})
    warm_in = [c for c in paired["calls"][3:] if c["mode"] == "in_process"]
    warm_iso = [c for c in paired["calls"][3:] if c["mode"] == "isolated"]
    own = [c for c in mix["calls"] if c["workload"] == workload]
    first_iso = paired["calls"][0]
    fig = {
        "in_process_imports_s": cold["torch_import_s"] + cold["advisor_import_s"],
        "in_process_first_s": cold["calls"][0]["wall_s"],
        "in_process_warm_s": _median(warm_in),
        "isolated_imports_s": paired["advisor_import_s"],
        "isolated_first_s": first_iso["wall_s"],
        "isolated_first_estimate_s": first_iso["estimate_s"],
        "isolated_warm_s": _median(warm_iso),
        "isolated_warm_outside_estimate_s": statistics.median(c["wall_s"] - c["estimate_s"] for c in warm_iso),
        "after_other_first_s": own[0]["wall_s"],
        "after_other_later_s": _median(own[1:]),
        "in_process_warm_cpu_s": _median(warm_in, "cpu_s"),
        "isolated_warm_cpu_s": _median(warm_iso, "cpu_s"),
    }
    fig["overhead_s"] = fig["isolated_warm_s"] - fig["in_process_warm_s"]
    fig["overhead_after_other_s"] = fig["after_other_later_s"] - fig["in_process_warm_s"]
    fig["overhead_cpu_s"] = fig["isolated_warm_cpu_s"] - fig["in_process_warm_cpu_s"]
    return {"workload": workload, "hardware": hardware, "other": other, "batch": BATCH, "figures": fig,
            "met": fig["overhead_s"] <= GOAL_S, "caller_imported_torch": first_iso["torch_in_caller_before"]
            or paired["calls"][1]["torch_in_caller_before"],
            "one_worker": all(c["processes"] == paired["calls"][2]["processes"] for c in warm_iso),
            "in_process_cold": cold, "paired": paired,
            "isolated_after_other": mix}


COLUMNS = ["workload", "hardware", "in process: imports s", "in process: first s", "in process: warm s",
           "isolated: imports s", "isolated: first s (the estimate's part)", "isolated: warm s",
           "of which outside the estimate s", "after another: first s", "after another: later s", "overhead s",
           "overhead, CPU s", "overhead after another s", f"overhead ≤ {GOAL_S} s"]


def row(r: dict[str, Any]) -> list[str]:
    f = r["figures"]
    return [r["workload"], r["hardware"], *(f"{f[k]:.2f}" for k in ("in_process_imports_s", "in_process_first_s",
                                                                      "in_process_warm_s", "isolated_imports_s")),
            f"{f['isolated_first_s']:.2f} ({f['isolated_first_estimate_s']:.2f})",
            *(f"{f[k]:.2f}" for k in ("isolated_warm_s", "isolated_warm_outside_estimate_s", "after_other_first_s",
                                      "after_other_later_s")),
            *(f"{f[k]:+.2f}" for k in ("overhead_s", "overhead_cpu_s", "overhead_after_other_s")),
            "PASS" if r["met"] else "FAIL"]


def markdown(res: dict[str, Any]) -> str:
    from bench.estimate_accuracy import _md_table

    m = res["meta"]
    dirty = " with uncommitted changes" if m["source"]["dirty"] else ""
    rows = res["rows"]
    several = [f"{r['workload']} on {r['hardware']}" for r in rows if not r["one_worker"]]
    torch_free = "never imports" if not any(r["caller_imported_torch"] for r in rows) else "IMPORTED"
    return "\n".join([
        "# Cost of isolation (bench/isolation_latency.py)", "",
        f"Run {m['started']} on {m['machine']['cpu']} ({m['cpu_count']} CPUs, load average "
        f"{m['load_avg_start'][0]:.1f} at the start, {m['load_avg_end'][0]:.1f} at the end), torch {m['torch']}, "
        f"commit `{m['source']['git_head']}`{dirty}, {m['seconds']:.0f} s: `{m['command']}`.", "",
        f"Batch {BATCH}, `EstimateOptions(calibrate=False)`; per row three fresh processes, each with a fresh "
        "ADVISOR_DATA_DIR. In process (`estimate_memory` in the measuring process): imports are `import torch` and "
        "the advisor's, first is the first estimate after them. Isolated (`advisor.isolation.estimate`: a worker "
        f"forked from a warm fork server): imports are the advisor's (the caller {torch_free} torch), first "
        "starts the fork server and the worker, and in brackets the estimator's own timer of it. Warm: in that "
        f"process, after one in-process estimate and one more isolated, {m['warm']} more of each, in-process and "
        "isolated in turn (ABBA, so both see the same load, all isolated ones in one worker): their medians, and of "
        "the isolated ones the time outside the estimator's timer. "
        "After another: a fresh process's worker estimated the next workload of the table first, then the two in "
        f"turn: this workload's first call and the median of its {MIXED - 1} later. Overhead: isolated warm minus "
        "in-process warm, in wall seconds and in CPU seconds of the caller's process tree (fork server and worker "
        f"included); after another: its later minus in-process warm. The goal: at most {GOAL_S} s. Every call's "
        "wall, CPU and estimator seconds are in the JSON. The machine may be shared: where the wall and CPU "
        "overheads differ, the CPU one is the figure its load does not move.", "",
        _md_table(COLUMNS, [row(r) for r in rows]), "",
        f"Goal met in {sum(r['met'] for r in rows)} of {len(rows)} rows.", "",
        *([f"Warm isolated calls in more than one worker: {', '.join(several)}.", ""] if several else [])])


def meta(argv: list[str], warm: int) -> dict[str, Any]:
    from importlib.metadata import version

    from bench.estimate_accuracy import _load_avg, machine, source_state

    source = source_state()
    return {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu_count": os.cpu_count(), "torch": version("torch"),
            "python": platform.python_version(), "warm": warm, "argv": argv,
            "command": " ".join([".venv/bin/python", "bench/isolation_latency.py", *argv]),
            "load_avg_start": _load_avg(), "source": source,
            "machine": machine()}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm", type=int, default=5, help="warm calls after the first, their median reported (5)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "isolation-latency.json")
    ap.add_argument("--render-only", action="store_true", help="rewrite the markdown from --out")
    ap.add_argument("--child-run", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_run:
        print(json.dumps(child(json.loads(args.child_run))))
        return 0
    from bench.estimate_accuracy import _atomic_write, _load_avg

    if args.render_only:
        _atomic_write(args.out.with_suffix(".md"), markdown(json.loads(args.out.read_text())))
        return 0

    t0 = time.monotonic()
    res: dict[str, Any] = {"meta": meta(argv, args.warm), "goal_s": GOAL_S, "rows": []}
    for hardware in HARDWARE:
        for i, workload in enumerate(WORKLOADS):
            print(f"{workload} on {hardware} ...", flush=True)
            r = measure(workload, hardware, WORKLOADS[(i + 1) % len(WORKLOADS)], args.warm)
            res["rows"].append(r)
            print("  " + ", ".join(f"{k} {v:.2f}" for k, v in r["figures"].items()), flush=True)
            res["meta"].update(seconds=time.monotonic() - t0, load_avg_end=_load_avg())
            _atomic_write(args.out, json.dumps(res, indent=1))
    md = markdown(res)
    _atomic_write(args.out.with_suffix(".md"), md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How much of `make demo`'s tuning run goes to anything but its measured trials, under each executor: the demo's
own `advisor tune` command (read from the Makefile), each run in a fresh process and a fresh data dir, the
executors alternated so that both see the same machine.

Goal: orchestration under 25% of the run's wall time on the demo. Orchestration is the run's
wall time less its measured trials' (`wall_s - trial_s` of the tune summary), as the summary prints it; its parts
are the summary's `stats` (start, memory estimates, Ray's stop, the rest: the search and the store).

    .venv/bin/python bench/demo_orchestration.py [--runs 3] [--out bench/results/demo-orchestration.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GOAL = 0.25  # orchestration's share of the run's wall time
# name -> (executor, arguments added to the demo's, held to the goal): the demo under each executor, and an anchor,
# the demo's trials timed for 1 s rather than the tuner's default (the run's fixed costs against shorter trials)
VARIANTS = {"inline": ("inline", [], True), "ray": ("ray", [], True),
            "inline, trials timed 1 s": ("inline", ["--min-time", "1"], False)}


def demo_args() -> list[str]:
    """The arguments after `advisor tune` in the Makefile's demo recipe: what `make demo` runs."""
    lines = (ROOT / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0].splitlines()
    (line,) = [x for x in lines if "advisor tune " in x]
    return shlex.split(line.split("advisor tune ", 1)[1])


def run_once(args: list[str], executor: str) -> dict[str, Any]:
    """One `advisor tune ARGS --executor E --json` in a fresh data dir: the process's wall time and the summary's."""
    data = Path(tempfile.mkdtemp(prefix="do-", dir="/tmp"))  # short: Ray's socket paths live under it
    cmd = [str(ROOT / ".venv" / "bin" / "advisor"), "tune", *args, "--executor", executor, "--json"]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900, check=False,
                              env={**os.environ, "ADVISOR_DATA_DIR": str(data)})
    finally:
        shutil.rmtree(data, ignore_errors=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    s = json.loads(proc.stdout)
    st = s["stats"]
    parts = {k: st.get(k, 0.0) for k in ("start_s", "estimate_s", "stop_s")}
    parts["search_and_store_s"] = max(0.0, s["wall_s"] - s["trial_s"] - sum(parts.values()))
    return {"executor": executor, "process_wall_s": time.monotonic() - t0, "run_wall_s": s["wall_s"],
            "trial_s": s["trial_s"], "measured": st["measured"], "statuses": s["statuses"],
            "orchestration": (s["wall_s"] - s["trial_s"]) / s["wall_s"], **parts}


def summarize(runs: list[dict[str, Any]], goal: bool = True) -> dict[str, Any]:
    keys = ("process_wall_s", "run_wall_s", "trial_s", "orchestration", "start_s", "estimate_s", "stop_s",
            "search_and_store_s")
    med = {k: statistics.median(r[k] for r in runs) for k in keys}
    return {**med, "orchestration_each": [r["orchestration"] for r in runs],
            "met": med["orchestration"] < GOAL if goal else None}


def meta(argv: list[str]) -> dict[str, Any]:
    from bench.estimate_accuracy import _load_avg, machine, source_state

    return {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "argv": argv,
            "command": " ".join([".venv/bin/python", "bench/demo_orchestration.py", *argv]),
            "load_avg_start": _load_avg(), "source": source_state(), "machine": machine()}


def markdown(res: dict[str, Any]) -> str:
    from bench.estimate_accuracy import _md_table

    m = res["meta"]
    dirty = " with uncommitted changes" if m["source"]["dirty"] else ""
    rows = [[e, f"{s['process_wall_s']:.1f}", f"{s['run_wall_s']:.1f}", f"{s['trial_s']:.1f}",
             f"{s['orchestration']:.0%}", ", ".join(f"{x:.0%}" for x in s["orchestration_each"]),
             f"{s['start_s']:.1f}", f"{s['estimate_s']:.1f}", f"{s['search_and_store_s']:.1f}", f"{s['stop_s']:.1f}",
             "—" if s["met"] is None else f"< {GOAL:.0%}", "—" if s["met"] is None else "yes" if s["met"] else "no"]
            for e, s in res["executors"].items()]
    return "\n".join([
        f"Run {m['started']} on {m['machine']['cpu']} ({m['cpu_count']} CPUs, load average "
        f"{(m['load_avg_start'] or [float('nan')])[0]:.1f} at the start), commit `{m['source']['git_head']}`{dirty}: "
        f"`{m['command']}`.", "",
        f"The demo's command: `advisor tune {' '.join(res['args'])}` (each trial timed for the tuner's default 2 s), "
        f"{res['runs']} runs per row, the rows alternated, each a fresh process and data dir. The anchor without a "
        "goal adds `--min-time 1`: the run's fixed costs against trials timed for 1 s. Medians; seconds.", "",
        _md_table(["executor", "process wall", "run wall", "measured trials", "orchestration", "runs'",
                   "start", "memory estimates", "search and store", "Ray's stop", "goal", "met"], rows), ""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs per executor (default 3)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "demo-orchestration.json")
    args = ap.parse_args(argv)
    res: dict[str, Any] = {"meta": meta(sys.argv[1:] if argv is None else argv), "args": demo_args(),
                           "runs": args.runs, "goal": GOAL}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    for i in range(args.runs):
        for name, (executor, extra, _) in VARIANTS.items():
            r = run_once([*res["args"], *extra], executor)
            runs[name].append(r)
            print(f"run {i + 1} {name}: {r['run_wall_s']:.1f} s, trials {r['trial_s']:.1f} s, "
                  f"orchestration {r['orchestration']:.0%}", flush=True)
    res["all_runs"] = runs
    res["executors"] = {name: summarize(rs, VARIANTS[name][2]) for name, rs in runs.items()}
    args.out.write_text(json.dumps(res, indent=1))
    md = markdown(res)
    args.out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

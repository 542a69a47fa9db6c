#!/usr/bin/env python
"""Each rank's estimate of a parallel layout against the same rank measured on real gloo ranks on this CPU.

    .venv/bin/python bench/parallel_accuracy.py [--cases all|quick] [--runs 3] \
        [--out bench/results/parallel-accuracy.json]

Per case (a workload and a layout: tp 2 and 4, pp 2 and 4, zero3 x tp 2 x 2, tp x pp 2 x 2; for decoders also
cp 2 under zero3, tp 2 x cp 2 under zero2, and HSDP 2 groups x 2 under zero3), the estimator's
per-rank figures (advisor.estimate.parallel.estimate_layout, traced under a fake process group) beside every rank
measured on real ranks (advisor.parallel.measure.run_rank, as measure_ranks runs it), --runs times, two figures a run:
- `alloc`: the live tensor bytes over every thread of the rank: each tensor's storage comes from c10's CPU allocator
  (posix_memalign) and goes back through free(); a preloaded shim (advisor/alloclog.py, built with gcc) logs both
  calls, in the order they happen on all threads, between the profiler's start and stop, and their replay's peak is
  the figure.
  The table gives the lowest run and the spread (highest over lowest).
- `profiler`: the profiler's figure of the same run (advisor.parallel.measure's): the profiler reports only the
  allocator calls of threads it follows, and gloo's worker threads drop a finished collective's work, the last
  reference to its input and output, outside any (ProcessGroupGloo::runLoop resets workInProgress_ there), so those
  frees go unreported and the replay counts the tensors live to the end: it reads high, by a varying amount.
- `sync`, once: the profiler's live tensor bytes of each rank's real program on real tensors, the rank alone in a
  fake process group whose collectives return at once: the program's own tensor lifetimes, with none held by a
  slower collective thread. The estimate against it isolates the estimator's model from gloo's timing.
- the collectives' payload bytes of the last step by kind, against the estimate's.
Goals: allocated peak median error <= 1%, max <= 3%; collective bytes within 1% for every rank and kind. Every rank's
figures go to --out (JSON), the table to the markdown beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from advisor import alloclog  # noqa: E402 - after the repository's root is on the path

GOAL_MEDIAN, GOAL_MAX, GOAL_COMM = 0.01, 0.03, 0.01
GOAL_SPEED_S = 5.0  # llama-70b at tp 8 x pp 4 x dp 2 (zero3), bf16, batch 8 per replica, on h100-sxm:64
SPEED_CODE = """
import json, time
t0 = time.perf_counter()
from advisor.estimate import EstimateRequest
from advisor.estimate.parallel import estimate_layout
from advisor.parallel import Layout
t1 = time.perf_counter()
est = estimate_layout("llama-70b", "h100-sxm:64", Layout(dp=2, tp=8, pp=4, strategy="zero3"),
                      EstimateRequest(batch_size=8, precision="bf16"))
t2 = time.perf_counter()
print(json.dumps({"imports_s": t1 - t0, "estimate_s": t2 - t1, "method": est.method, "fits": est.fits,
                  "rank_totals": [r.total_bytes for r in est.ranks]}))
"""

# decoder shapes: Llama-like (GQA, SwiGLU, RMSNorm), GPT-like (MHA, GELU, LayerNorm, learned positions), a wide
# MHA one; sizes where the step, not the build, sets the peak, and that gloo runs in seconds on two cores
SHAPES = {
    "llama-like": {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 4, "vocab": 4096, "seq_len": 128},
    "gpt-like": {"layers": 4, "hidden": 256, "heads": 8, "mlp": "gelu", "norm": "layernorm",
                 "positions": "learned", "bias": True, "vocab": 4096, "seq_len": 128},
    "wide-mha": {"layers": 4, "hidden": 512, "heads": 8, "ffn": 1024, "vocab": 2048, "seq_len": 64},
}
MLP = ("mlp", {"in_features": 512, "hidden": 1024, "layers": 4, "classes": 10})
LAYOUTS = {
    "tp2": {"tp": 2}, "tp4": {"tp": 4}, "pp2": {"pp": 2}, "pp4": {"pp": 4},
    "zero3-tp2x2": {"dp": 2, "tp": 2, "strategy": "zero3"}, "tp2-pp2": {"tp": 2, "pp": 2},
    "zero3-cp2": {"cp": 2, "strategy": "zero3"}, "zero2-tp2-cp2": {"tp": 2, "cp": 2, "strategy": "zero2"},
    "hsdp2x2-zero3": {"dp": 4, "dp_replicate": 2, "strategy": "zero3"},
}
BATCH = 8


def cases(which: str) -> list[tuple[str, str, dict[str, Any], str, dict[str, Any]]]:
    """(label, workload, args, layout name, layout fields) for each case."""
    out = []
    for shape, args in SHAPES.items():
        for name, fields in LAYOUTS.items():
            out.append((shape, "decoder", args, name, fields))
    out += [("mlp", MLP[0], MLP[1], name, LAYOUTS[name]) for name in ("tp2", "tp4", "zero3-tp2x2")]
    if which == "quick":
        return [c for c in out if c[0] in ("llama-like", "mlp") and c[3] in ("tp2", "pp2", "zero3-tp2x2")]
    return out


def run_case(label: str, workload: str, args: dict[str, Any], layout_name: str, fields: dict[str, Any],
             runs: int, shim: str) -> dict:
    from advisor.estimate.model import EstimateRequest
    from advisor.estimate.parallel import estimate_layout
    from advisor.parallel import Layout
    from advisor.parallel.measure import RankMeasureRequest, measure_ranks

    layout = Layout(**fields)
    t0 = time.perf_counter()
    est = estimate_layout(workload, f"cpu:{layout.world}", layout, EstimateRequest(batch_size=BATCH),
                          workload_args=args)
    est_s = time.perf_counter() - t0
    req = RankMeasureRequest(workload=workload, workload_args=args, layout=layout, batch_size=BATCH)
    alone = measure_ranks(req.model_copy(update={"mode": "sync"}))
    allocs = [measure_threads(req, shim) for _ in range(runs)]
    ranks = []
    for r, t in enumerate(alone):
        e = est.for_rank(r)
        runs_r = [a[r][1] for a in allocs]
        prof_r = [a[r][0].alloc_peak_bytes for a in allocs]
        comm = allocs[-1][r][0].comm_bytes
        comm_err = {k: _rel(e.comm_bytes.get(k, 0), v) for k, v in comm.items()}
        comm_err.update({k: 1.0 for k in e.comm_bytes if k not in comm})
        ranks.append({"rank": r, "coords": t.coords, "stages": e.stages, "estimate": e.allocated_bytes,
                      "alone": t.alloc_peak_bytes, "alloc_runs": runs_r, "profiler_runs": prof_r,
                      "error_alone": _rel(e.allocated_bytes, t.alloc_peak_bytes),
                      "error": _rel(e.allocated_bytes, min(runs_r)), "spread": max(runs_r) / min(runs_r) - 1,
                      "error_profiler": _rel(e.allocated_bytes, min(prof_r)),
                      "comm_estimate": e.comm_bytes, "comm_measured": comm, "comm_error": comm_err})
    return {"case": label, "workload": workload, "args": args, "layout": layout_name, "fields": fields,
            "estimate_s": est_s, "ranks": ranks}


def measure_threads(req: Any, shim: str, timeout_s: float = 600.0) -> list[tuple[Any, int]]:
    """Every rank of `req` on real gloo ranks running measure_ranks's program (`rank_main`), each a fresh process so
    that `shim` is preloaded: per rank (its RankMeasure, with the profiler's figure; the live tensor bytes of all
    its threads, replayed)."""
    from advisor.measure import PROFILED_MMAP_THRESHOLD
    from advisor.parallel.measure import RankMeasure, free_port
    from advisor.procmem import malloc_env

    world = req.layout.world
    env = dict(malloc_env(PROFILED_MMAP_THRESHOLD), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), LD_PRELOAD=shim)
    with tempfile.TemporaryDirectory(prefix="advisor-ranks-") as out:
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", req.model_dump_json()],
                                  env=dict(env, RANK=str(r), LOCAL_RANK=str(r), ADVISOR_RANK_OUT=f"{out}/{r}"),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
                 for r in range(world)]
        errors = _wait_popen(procs, timeout_s)
        if errors:
            raise RuntimeError(f"{req.workload} ({req.layout.label()}): {errors[0]}")
        return [(RankMeasure.model_validate_json(Path(f"{out}/{r}").read_text()),
                 int(Path(f"{out}/{r}.threads").read_text())) for r in range(world)]


def _wait_popen(procs: list[subprocess.Popen], timeout_s: float) -> list[str]:
    """Wait for every rank; kill them all past `timeout_s`. One line per rank that failed."""
    deadline = time.monotonic() + timeout_s
    errors = []
    for rank, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            return [f"timed out after {timeout_s:.0f} s"]
        if proc.returncode != 0:
            lines = [ln for ln in err.strip().splitlines() if ln.strip()]
            errors.append(f"rank {rank} exit {proc.returncode}: {lines[-1] if lines else '(no output)'}")
    return errors


def rank_main(req_json: str) -> None:
    """One rank of `measure_threads`: advisor.parallel.measure.run_rank, the shim logging from the profiler's start
    to its stop (the build and the measured steps), then the log's replay."""
    import torch.profiler

    from advisor.parallel.measure import RankMeasureRequest, run_rank

    out = os.environ["ADVISOR_RANK_OUT"]
    log = out + ".log"

    class Logged(torch.profiler.profile):
        def __enter__(self) -> Any:
            entered = super().__enter__()
            alloclog.start(log)
            return entered

        def __exit__(self, *exc: Any) -> Any:
            alloclog.stop()
            return super().__exit__(*exc)

    torch.profiler.profile = Logged  # run_rank imports it when it runs
    result = run_rank(RankMeasureRequest.model_validate_json(req_json))
    Path(out).write_text(result.model_dump_json())
    Path(out + ".threads").write_text(str(alloclog.replay(log)))
    sys.stdout.flush()
    time.sleep(0.2)  # trial.GLOO_EXIT_PAUSE_S: gloo's workers finish freeing before the interpreter goes
    os._exit(0)


def _rel(estimate: float, measured: float) -> float:
    return (estimate - measured) / measured if measured else (0.0 if not estimate else 1.0)


def speed() -> dict[str, Any]:
    """The llama-70b layout estimate in a fresh process: imports, then the call (wall seconds)."""
    out = subprocess.run([sys.executable, "-c", SPEED_CODE], capture_output=True, text=True, cwd=ROOT, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return {**res, "goal_s": GOAL_SPEED_S, "met": res["estimate_s"] <= GOAL_SPEED_S}


def summary(results: list[dict]) -> dict[str, Any]:
    ranks = [r for c in results for r in c["ranks"]]
    errors = [abs(r["error"]) for r in ranks]
    alone = [abs(r["error_alone"]) for r in ranks]
    prof = [abs(r["error_profiler"]) for r in ranks]
    comm = [abs(e) for r in ranks for e in r["comm_error"].values()]
    med, mx, cmax = statistics.median(errors), max(errors), max(comm, default=0.0)
    return {"ranks": len(errors), "median": med, "max": mx, "comm_max": cmax,
            "alone_median": statistics.median(alone), "alone_max": max(alone),
            "profiler_median": statistics.median(prof), "profiler_max": max(prof),
            "spread_median": statistics.median(r["spread"] for r in ranks),
            "spread_max": max(r["spread"] for r in ranks),
            "met": med <= GOAL_MEDIAN and mx <= GOAL_MAX and cmax <= GOAL_COMM}


def markdown(results: list[dict], s: dict[str, Any], meta: dict[str, Any]) -> str:
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    where = f"{meta['machine']['cpu']}, {meta['cpu_count']} CPUs"
    lines = [f"`{meta['command']}` on {meta['commit']}, {where}, {meta['date']}.", "",
             f"Allocated peak per rank (the live tensor bytes of all its threads, lowest of {meta['runs']} runs) "
             f"against the estimate: median {pct(s['median'])}, max {pct(s['max'])} over {s['ranks']} ranks (goal "
             f"{pct(GOAL_MEDIAN)} / {pct(GOAL_MAX)}); collective bytes max error {100 * s['comm_max']:.2f}% (goal "
             f"{pct(GOAL_COMM)}): {'met' if s['met'] else 'not met'}. Against each rank's program alone (collectives "
             f"returning at once): median {pct(s['alone_median'])}, max {pct(s['alone_max'])}. Against the "
             f"profiler's figure of the same runs (blind to the frees of gloo's worker threads): median "
             f"{pct(s['profiler_median'])}, max {pct(s['profiler_max'])}. Run-to-run spread of the peak: median "
             f"{pct(s['spread_median'])}, max {pct(s['spread_max'])}.", "",
             f"llama-70b at tp 8 x pp 4 x dp 2 (zero3), bf16, batch 8, on h100-sxm:64: estimated in "
             f"{s['speed']['estimate_s']:.2f} s ({s['speed']['method']}; goal {GOAL_SPEED_S:.0f} s: "
             f"{'met' if s['speed']['met'] else 'not met'}), after {s['speed']['imports_s']:.1f} s of imports.", "",
             "| case | layout | error vs lowest run, per rank | vs the rank alone | vs the profiler's figure "
             "| spread of runs | comm max error |",
             "|---|---|---|---|---|---|---|"]
    for c in results:
        errs = " ".join(f"{100 * r['error']:+.1f}" for r in c["ranks"])
        alone = " ".join(f"{100 * r['error_alone']:+.1f}" for r in c["ranks"])
        prof = " ".join(f"{100 * r['error_profiler']:+.1f}" for r in c["ranks"])
        spread = max(r["spread"] for r in c["ranks"])
        comm = max((abs(e) for r in c["ranks"] for e in r["comm_error"].values()), default=0.0)
        lines.append(f"| {c['case']} | {c['layout']} | {errs} | {alone} | {prof} | {pct(spread)} "
                     f"| {100 * comm:.2f}% |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", choices=["all", "quick"], default="all")
    parser.add_argument("--runs", type=int, default=3, help="measured runs per case (the lowest is compared)")
    parser.add_argument("--out", default=str(ROOT / "bench/results/parallel-accuracy.json"))
    parser.add_argument("--rank", help=argparse.SUPPRESS)  # one rank of measure_threads: its request (JSON)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank)
    from rich.progress import track

    shim = alloclog.shim_path()
    if shim is None:
        sys.exit("the storage logger needs gcc (advisor/alloclog.py)")
    results = [run_case(*c, runs=args.runs, shim=shim) for c in track(cases(args.cases), description="cases")]
    from bench.estimate_accuracy import machine

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    meta = {"command": "bench/parallel_accuracy.py " + " ".join(sys.argv[1:]), "commit": commit.strip(),
            "machine": machine(), "cpu_count": os.cpu_count(), "date": time.strftime("%Y-%m-%d"), "runs": args.runs}
    s = summary(results)
    s["speed"] = speed()
    Path(args.out).write_text(json.dumps({"meta": meta, "summary": s, "cases": results}, indent=1))
    Path(args.out).with_suffix(".md").write_text(markdown(results, s, meta))
    print(markdown(results, s, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())

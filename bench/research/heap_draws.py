#!/usr/bin/env python
"""Offline: how far the heap's replay at the batch moves with the draw, and how many draws it takes.

    ADVISOR_DATA_DIR=$(mktemp -d) .venv/bin/python bench/research/heap_draws.py [--seeds 10] [--runs 7] \
        [--out F.jsonl] CASE [CASE ...]
    .venv/bin/python bench/research/heap_draws.py --read F.jsonl
    CASE = workload:precision:optimizer:batch[:key=value,...]   e.g. bench/workloads/unseen.py:audio:fp32:adamw:32

Per case: the calibration's logged runs (advisor.measure, rss mode, `heap_log`, at its batch sizes, the top
one `top_runs` times, under glibc's default), each log replayed under `--seeds` seeds at its own batch and
rescaled to the case's (heaplog.replay, seed 0 the heap as found, others 16 B to 128 KiB held first), then
`--runs` real runs at the batch (docs/design.md's CPU protocol). Then, from those replays, the prediction at the
batch (heaplog.pooled: the median of the draws at the batch, plus the runs' mean excess over their own draws)
with K draws per log, K = 1, 2, 3, 5, over 300 random choices of which seeds: its mean error against the runs'
median and its spread (standard deviation) over the choices. heaplog.DRAWS is chosen from that spread.
A tool for deciding the model, not a benchmark of a goal; bench/results/archive/heap_draws.jsonl keeps its draws.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "research"))

from mapped_moments import parse_case  # noqa: E402

from advisor.estimate.estimator import _batch_model  # noqa: E402
from advisor.estimate.model import EstimateRequest  # noqa: E402
from advisor.estimate.resident import heaplog  # noqa: E402
from advisor.estimate.resident.calibrate import calibration_batches, top_runs  # noqa: E402
from advisor.measure import MeasureRequest, measure  # noqa: E402
from advisor.workload import load_workload  # noqa: E402

MiB = 2**20


def collect(case: str, seeds: int, runs: int) -> dict | None:
    spec, prec, opt, batch, args = parse_case(case)
    req = EstimateRequest.of(batch, precision=prec, optimizer=opt, strategy="single", checkpointing=False,
                             fused_backward=False, offload_optimizer=False, offload_params=False, optimizer_impl=None)
    bm = _batch_model(load_workload(spec, args), req, cpu=True)
    batches = list(calibration_batches(batch))
    batches += [batches[-1]] * (top_runs(0) - 1)
    rec: dict = {"case": case, "logs": []}
    with tempfile.TemporaryDirectory(prefix="heap-draws-") as tmp:
        for i, b in enumerate(batches):
            if len(bm.at(b).sizes) != len(bm.at(batch).sizes):
                print(f"{case}: the traces at {b} and {batch} do not align; the estimator replays none here")
                return None
            log, scaled = f"{tmp}/run{i}.heaplog", f"{tmp}/scaled{i}.heaplog"
            measured = measure(MeasureRequest(workload=spec, workload_args=args, batch_size=b, precision=prec,
                                              optimizer=opt, heap_log=log)).rss_delta_bytes or 0
            keys, values = heaplog.size_map(bm.at(b).sizes, bm.at(batch).sizes)
            heaplog.rescale(heaplog.read_log(log), keys, values).tofile(scaled)
            d = {"batch": b, "measured": measured, "own": [heaplog.replay(log, seed=s) for s in range(seeds)],
                 "scaled": [heaplog.replay(scaled, seed=s) for s in range(seeds)]}
            rec["logs"].append(d)
            print(f"  run at {b}: {measured / MiB:.0f} MiB; its own draws {[x // MiB for x in d['own']]}, "
                  f"at {batch} {[x // MiB for x in d['scaled']]}", flush=True)
    rec["real"] = [measure(MeasureRequest(workload=spec, workload_args=args, batch_size=batch, precision=prec,
                                          optimizer=opt)).rss_delta_bytes or 0 for _ in range(runs)]
    return rec


def report(rec: dict, choices: int = 300) -> None:
    real = statistics.median(rec["real"])
    logs, rng = rec["logs"], random.Random(0)
    n = min(len(d["own"]) for d in logs)
    cells = []
    for k in (1, 2, 3, 5):
        if k > n:
            break
        errs = []
        for _ in range(choices):
            runs = []
            for d in logs:
                own, at = rng.sample(range(n), k), rng.sample(range(n), k)
                runs.append(heaplog.Replayed(int(d["measured"] - np.median([d["own"][i] for i in own])),
                                             tuple(d["scaled"][i] for i in at)))
            errs.append(heaplog.pooled(runs) / real - 1)
        cells.append(f"K={k}: {np.mean(errs):+.1%} ± {np.std(errs):.1%}")
    print(f"{rec['case']}: runs at the batch {[x // MiB for x in rec['real']]} MiB (median {real / MiB:.0f}); "
          + " | ".join(cells), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--runs", type=int, default=7, help="real runs at the batch")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--read", type=Path, help="report a kept JSONL file instead of running")
    a = ap.parse_args()
    if a.read:
        for line in a.read.read_text().splitlines():
            report(json.loads(line))
        return
    if heaplog.tools() is None:
        sys.exit("heaplog's logger cannot be built here: it needs Linux with glibc and a C compiler")
    for case in a.cases:
        rec = collect(case, a.seeds, a.runs)
        if rec is None:
            continue
        report(rec)
        if a.out:
            with a.out.open("a") as f:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()

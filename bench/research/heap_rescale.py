#!/usr/bin/env python
"""Offline: the calibration's logged runs replayed at the batch, their tensor requests resized by size alone
against by phase (advisor.estimate.resident.heaplog.rescaled), each against real runs at the batch.

    ADVISOR_DATA_DIR=$(mktemp -d) .venv/bin/python bench/research/heap_rescale.py [--runs K] [--out F.jsonl] \
        CASE [CASE ...]
    CASE = workload:precision:optimizer:batch[:key=value,...]   e.g. vit-b16:bf16:adamw:16:image_size=112

Per case: the resident-set runs a calibration for the batch makes where none runs at the batch itself
(calibrate.calibration_batches, the largest twice: top_runs), two at a time and logged, as calibrate_cpu runs them;
each log resized to the batch by the fake trace's sizes, by size alone (heaplog.size_map) and by phase (the run's
marks), replayed DRAWS times and pooled as the estimator pools them (heaplog.pooled); then K real runs at the batch
(docs/design.md's CPU protocol). Prints and, with --out, appends one JSON line per case. A tool for deciding the
model, not a benchmark of a goal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "research"))

from mapped_moments import parse_case  # noqa: E402

from advisor.estimate.estimator import _batch_model  # noqa: E402
from advisor.estimate.model import EstimateRequest  # noqa: E402
from advisor.estimate.resident import heaplog  # noqa: E402
from advisor.estimate.resident.calibrate import _rss_jobs, _run_parallel, calibration_batches, top_runs  # noqa: E402
from advisor.measure import MeasureRequest, measure  # noqa: E402
from advisor.workload import load_workload  # noqa: E402

MiB = 2**20


def compare(case: str, k: int) -> dict | None:
    spec, prec, opt, batch, args = parse_case(case)
    req = EstimateRequest.of(batch, precision=prec, optimizer=opt, strategy="single", checkpointing=False,
                             fused_backward=False, offload_optimizer=False, offload_params=False, optimizer_impl=None)
    bm = _batch_model(load_workload(spec, args), req, cpu=True)
    at = bm.at(batch)
    sizes = calibration_batches(batch)
    runs = [("rss", b) for b in sizes] + [("rss", sizes[-1], "again", i) for i in range(1, top_runs(0))]
    by_size, by_phase = [], []
    with tempfile.TemporaryDirectory(prefix="heap-rescale-") as logs:
        res = _run_parallel(_rss_jobs(spec, args, req, runs, None, logs))
        for r in runs:
            m = res[r]
            run = bm.at(m.request.batch_size)
            if len(run.sizes) != len(at.sizes):
                print(f"{case}: the trace's allocations differ between batch sizes: the estimator replays nothing")
                return None
            measured = int(m.rss_delta_bytes or 0)
            by_size.append(heaplog.replay_at(m.request.heap_log, measured, None, run.sizes, at.sizes))
            by_phase.append(heaplog.replay_at(m.request.heap_log, measured, None, run.sizes, at.sizes,
                                              phases=run.phases))
    real = [measure(MeasureRequest(workload=spec, workload_args=args, batch_size=batch, precision=prec,
                                   optimizer=opt)).rss_delta_bytes or 0 for _ in range(k)]
    med = statistics.median(real)
    old, new = heaplog.pooled(by_size), heaplog.pooled(by_phase)
    row = {"case": case, "runs_at": sorted({b for _, b, *_ in runs}), "real_mib": [round(x / MiB) for x in real],
           "by_size_mib": round(old / MiB), "by_phase_mib": round(new / MiB),
           "by_size_err": round(old / med - 1, 4), "by_phase_err": round(new / med - 1, 4)}
    print(f"{case}: real {', '.join(map(str, row['real_mib']))} MiB; replayed by size {row['by_size_mib']} MiB "
          f"({row['by_size_err']:+.1%}), by phase {row['by_phase_mib']} MiB ({row['by_phase_err']:+.1%})")
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--runs", type=int, default=3, help="real runs at the batch (default 3)")
    ap.add_argument("--out", type=Path, default=None, help="append one JSON line per case here")
    a = ap.parse_args()
    if heaplog.tools() is None:
        print("heaplog's logger cannot be built here (Linux with glibc and a C compiler needed)")
        return 2
    for case in a.cases:
        row = compare(case, a.runs)
        if row is not None and a.out is not None:
            with a.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

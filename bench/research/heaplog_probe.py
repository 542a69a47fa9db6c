#!/usr/bin/env python
"""Offline: each calibration run's heap, logged and replayed at the batch, against real runs there.

    ADVISOR_DATA_DIR=$(mktemp -d) .venv/bin/python bench/research/heaplog_probe.py [--runs K] CASE [CASE ...]
    CASE = workload:precision:optimizer:batch[:key=value,...]   e.g. vit-b16:fp32:adamw:16:image_size=112

Per case: one logged run (advisor.measure, rss mode, `heap_log`) at each of the calibration's batch sizes
(calibrate.calibration_batches), under glibc's default; for each, what it measured, its log replayed as
logged (advisor.estimate.resident.heaplog.replay) and the prediction at the batch (heaplog.predict: the log's tensor
requests resized by the fake trace's sizes, replayed, plus the run's measured excess over its own replay);
then K real runs at the batch (docs/design.md's CPU protocol) and each prediction's error against their median.
The estimator takes the median of its runs' predictions as one run at the batch (calibrate.replay_at_batch).
A tool for deciding the model, not a benchmark of a goal.
"""

from __future__ import annotations

import argparse
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
from advisor.estimate.resident.calibrate import calibration_batches  # noqa: E402
from advisor.measure import MeasureRequest, measure  # noqa: E402
from advisor.workload import load_workload  # noqa: E402

MiB = 2**20


def probe(case: str, k: int) -> None:
    spec, prec, opt, batch, args = parse_case(case)
    req = EstimateRequest.of(batch, precision=prec, optimizer=opt, strategy="single", checkpointing=False,
                             fused_backward=False, offload_optimizer=False, offload_params=False, optimizer_impl=None)
    bm = _batch_model(load_workload(spec, args), req, cpu=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="heaplog-probe-") as tmp:
        for b in calibration_batches(batch):
            log = str(Path(tmp) / f"b{b}.heaplog")
            run = measure(MeasureRequest(workload=spec, workload_args=args, batch_size=b, precision=prec,
                                         optimizer=opt, heap_log=log)).rss_delta_bytes or 0
            own = heaplog.replay(log)
            rows.append((b, run, own, heaplog.predict(log, run, None, bm.at(b).sizes, bm.at(batch).sizes)))
    real = [measure(MeasureRequest(workload=spec, workload_args=args, batch_size=batch, precision=prec,
                                   optimizer=opt)).rss_delta_bytes or 0 for _ in range(k)]
    med = statistics.median(real)
    print(f"{case}: real at {batch}: {', '.join(f'{r / MiB:.0f}' for r in real)} MiB (median {med / MiB:.0f})")
    for b, run, own, at in rows:
        print(f"  from {b}: run {run / MiB:.0f}, its replay {own / MiB:.0f}, predicted at {batch}: {at / MiB:.0f} MiB "
              f"({at / med - 1:+.1%})")
    pred = statistics.median(at for *_, at in rows)
    print(f"  median of the predictions: {pred / MiB:.0f} MiB ({pred / med - 1:+.1%})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--runs", type=int, default=3, help="real runs at the batch")
    a = ap.parse_args()
    if heaplog.tools() is None:
        sys.exit("heaplog's logger cannot be built here: it needs Linux with glibc and a C compiler")
    for case in a.cases:
        probe(case, a.runs)


if __name__ == "__main__":
    main()

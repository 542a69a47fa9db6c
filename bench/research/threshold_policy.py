#!/usr/bin/env python
"""On one machine: the resident-set estimate with calibration runs under glibc's default mmap threshold,
under a threshold scaled to their share of the batch, and as the estimator chooses between them.

    .venv/bin/python bench/research/threshold_policy.py [--out bench/results/threshold_policy.json] \\
        'mlp|fp32|adamw|4096' 'dlrm|fp32|adamw|2048|rows=100000' ...

A case is workload|precision|optimizer|batch[|key=value,...] (workload args as in `--workload-arg`).
Per case, in this order and nothing else running: the real peak resident set at the batch (docs/design.md's
protocol, 3 fresh `advisor.measure` runs, median), then `calibrate_cpu` twice (its runs at the same
batch sizes: once with `scale_threshold=False`, once with True), each fitted by the estimator's own
fit and evaluated at the batch. "chosen" is the one `threshold.crosses` picks (what `advisor estimate`
does). Resident sets of the same runs differ between machines, so this compares the policies against
targets measured here, in the same run, not the accuracy grid's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from advisor.estimate.estimator import _batch_model  # noqa: E402
from advisor.estimate.evaluator import Evaluator  # noqa: E402
from advisor.estimate.model import EstimateRequest  # noqa: E402
from advisor.estimate.resident.calibrate import calibrate_cpu, calibration_batches  # noqa: E402
from advisor.estimate.resident.threshold import threshold_target  # noqa: E402
from advisor.hardware import get_hardware  # noqa: E402
from advisor.measure import MeasureRequest, measure  # noqa: E402
from advisor.workload import load_workload, parse_workload_args  # noqa: E402

MB = 1e6


def run_case(spec: str) -> dict:
    name, prec, opt, batch, *rest = spec.split("|")
    args = parse_workload_args(rest[0].split(",")) if rest and rest[0] else {}
    b = int(batch)
    hw = get_hardware("cpu")
    req = EstimateRequest.of(b, precision=prec, optimizer=opt, strategy="single", checkpointing=False,
                             fused_backward=False, offload_optimizer=False, offload_params=False, optimizer_impl=None)
    real_req = MeasureRequest(workload=name, workload_args=args, batch_size=b, precision=prec, optimizer=opt,
                              mode="rss")
    with ThreadPoolExecutor(max_workers=2) as pool:  # as the accuracy grid measures: two at a time
        real_runs = [f.result().rss_delta_bytes for f in [pool.submit(measure, real_req) for _ in range(3)]]
    real = statistics.median(real_runs)
    bm = _batch_model(load_workload(name, args), req, cpu=True)
    rec = {"case": spec, "real_runs": real_runs, "real": real, "runs_at": calibration_batches(b),
           "chosen": "scaled" if threshold_target(req, bm, calibration_batches(b), b) is not None else "default"}
    for policy, scale in (("default", False), ("scaled", True)):
        calib, chosen = calibrate_cpu(name, args, req, bm, scale_threshold=scale)
        pred = Evaluator(hw, req, chosen, calib).predicted_total(b)
        rec[policy] = {"runs": calib.rss, "slope": calib.slope, "intercept": calib.intercept, "pred": pred,
                       "err": (pred - real) / real}
    return rec


def table(records: list[dict]) -> str:
    rows = ["| case | runs at | real MB (3 runs) | default runs: err | scaled threshold: err | chosen | chosen err |",
            "|---|---|---|---|---|---|---|"]
    for r in records:
        runs = ", ".join(map(str, r["runs_at"]))
        lo, hi = min(r["real_runs"]) / MB, max(r["real_runs"]) / MB
        rows.append(f"| {r['case'].replace('|', ' ')} | {runs} | {r['real'] / MB:.0f} ({lo:.0f}-{hi:.0f}) | "
                    f"{r['default']['err']:+.1%} | {r['scaled']['err']:+.1%} | {r['chosen']} | "
                    f"{r[r['chosen']]['err']:+.1%} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "threshold_policy.json"))
    a = ap.parse_args()
    t0, records = time.time(), []
    for spec in a.cases:
        records.append(run_case(spec))
        print(json.dumps(records[-1]), flush=True)
    meta = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)), "seconds": time.time() - t0,
            "argv": sys.argv[1:]}
    Path(a.out).write_text(json.dumps({"meta": meta, "cases": records}, indent=1))
    print(table(records))


if __name__ == "__main__":
    main()

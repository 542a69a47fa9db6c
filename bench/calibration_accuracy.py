#!/usr/bin/env python
"""Estimate error before and after one measured trial (issue 3, item 3), on this machine's CPU.

    .venv/bin/python bench/calibration_accuracy.py [--out bench/results/calibration.json]

Per workload: one measured "trial" at batch A (`advisor.measure`, mode rss, one run: what a trial
gives) is recorded with `record_measured_peak`; then `estimate_memory` at batch B = 4 x A is
compared with the real peak at B (median of 3 fresh-process runs, DESIGN.md's protocol), before
(measured=False) and after (the store holding the trial's point). Both with the short real
calibration runs allowed (calibrate=True, the default on this CPU) and without (calibrate=False,
the uncalibrated default overhead). Relative error = (estimate - measured) / measured.
The markdown goes beside the JSON (.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GB = 1e9


@dataclass(frozen=True)
class Case:
    workload: str
    args: dict[str, Any]
    precision: str
    optimizer: str
    trial_batch: int  # A: the measured trial
    target_batch: int  # B: where the estimate is checked


CASES = [
    Case("mlp", {}, "fp32", "adamw", 1024, 4096),
    Case("resnet18", {"image_size": 64}, "fp32", "adamw", 32, 128),
    Case("gpt2-small", {"seq_len": 64}, "fp32", "sgd-momentum", 2, 8),
]


def _rss(pool: ThreadPoolExecutor, c: Case, batch: int, runs: int) -> list[int]:
    from advisor.measure import MeasureRequest, measure

    req = MeasureRequest(workload=c.workload, workload_args=c.args, batch_size=batch, precision=c.precision,
                         optimizer=c.optimizer, mode="rss")
    return [int(f.result().rss_delta_bytes) for f in [pool.submit(measure, req) for _ in range(runs)]]


def _estimate(c: Case, batch: int, calibrate: bool, measured):
    from advisor.estimate import estimate_memory

    return estimate_memory(c.workload, "cpu", batch, precision=c.precision, optimizer=c.optimizer,
                           workload_args=c.args, calibrate=calibrate, measured=measured)


def run_case(c: Case, pool: ThreadPoolExecutor) -> dict[str, Any]:
    from advisor.hardware import get_hardware
    from advisor.peaks import JsonlPeaks, record_measured_peak
    from advisor.workload import load_workload

    t0 = time.perf_counter()
    trial = _rss(pool, c, c.trial_batch, 1)[0]
    target_runs = _rss(pool, c, c.target_batch, 3)
    real = int(statistics.median(target_runs))
    rec: dict[str, Any] = {"workload": c.workload, "workload_args": c.args, "precision": c.precision,
                           "optimizer": c.optimizer, "trial_batch": c.trial_batch, "target_batch": c.target_batch,
                           "trial_rss_bytes": trial, "target_rss_runs": target_runs, "target_rss_bytes": real}
    for calibrate in (True, False):
        with tempfile.TemporaryDirectory(prefix="advisor-peaks-") as tmp:
            store = JsonlPeaks(tmp)
            before = _estimate(c, c.target_batch, calibrate, False)
            at_trial = _estimate(c, c.trial_batch, calibrate, False)
            record_measured_peak(load_workload(c.workload, c.args), get_hardware("cpu"), at_trial.request, "none",
                                 trial, "cpu_rss", at_trial.total_bytes, store=store)
            after = _estimate(c, c.target_batch, calibrate, store)
        tag = "calibrated" if calibrate else "uncalibrated"
        rec[tag] = {"before_bytes": before.total_bytes, "after_bytes": after.total_bytes,
                    "predicted_at_trial_bytes": at_trial.total_bytes, "refined_by": after.refined_by,
                    "before_err": (before.total_bytes - real) / real, "after_err": (after.total_bytes - real) / real,
                    "notes": after.notes}
    rec["seconds"] = time.perf_counter() - t0
    return rec


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def markdown(results: dict[str, Any]) -> str:
    m = results["meta"]
    lines = [f"Run {m['started']} on {m['host']} ({m['cpu_count']} CPUs, torch {m['torch']}), "
             f"load average {m['load_avg_start']}.", "",
             "| workload | prec | opt | trial batch | trial RSS GB | target batch | real RSS GB (median of 3) | "
             "calibrated: before | after | uncalibrated: before | after |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["cases"]:
        args = ",".join(f"{k}={v}" for k, v in r["workload_args"].items())
        cal, unc = r["calibrated"], r["uncalibrated"]
        lines.append(f"| {r['workload']}{f' ({args})' if args else ''} | {r['precision']} | {r['optimizer']} | "
                     f"{r['trial_batch']} | {r['trial_rss_bytes'] / GB:.3f} | {r['target_batch']} | "
                     f"{r['target_rss_bytes'] / GB:.3f} | {_pct(cal['before_err'])} | {_pct(cal['after_err'])} | "
                     f"{_pct(unc['before_err'])} | {_pct(unc['after_err'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "calibration.json")
    ap.add_argument("--only", default=None, help="comma-separated workload names")
    args = ap.parse_args(argv)
    import logging

    import torch

    logging.getLogger("advisor").setLevel(logging.ERROR)
    cases = [c for c in CASES if not args.only or c.workload in args.only.split(",")]
    results: dict[str, Any] = {"meta": {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
                                        "cpu_count": os.cpu_count(), "torch": torch.__version__,
                                        "load_avg_start": [round(x, 1) for x in os.getloadavg()]}, "cases": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=2) as pool:
        for c in cases:
            rec = run_case(c, pool)
            results["cases"].append(rec)
            print(f"{c.workload}: real {rec['target_rss_bytes'] / GB:.3f} GB at {c.target_batch}; calibrated "
                  f"{_pct(rec['calibrated']['before_err'])} -> {_pct(rec['calibrated']['after_err'])}, uncalibrated "
                  f"{_pct(rec['uncalibrated']['before_err'])} -> {_pct(rec['uncalibrated']['after_err'])} "
                  f"({rec['seconds']:.0f} s)", flush=True)
            args.out.write_text(json.dumps(results, indent=1))
            args.out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

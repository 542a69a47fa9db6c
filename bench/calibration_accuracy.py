#!/usr/bin/env python
"""Estimate error before and after one measured trial (issue 3, item 3), on this machine's CPU.

    .venv/bin/python bench/calibration_accuracy.py [--out bench/results/calibration.json] [--only mlp,...]
                                                   [--skip maxbatch]

Per workload: one measured trial at batch A (`probes.run_trial` with record_peak='always': after the
trial, one fresh-process run of docs/design.md's CPU protocol, kept as a measured peak; the trial's forked
rank's own peak is not that quantity, see probes/runner.py `_record_peak`); then `estimate_memory`
at batch B = 4 x A is compared with the real peak at B (median of 3 fresh-process runs), before
(measured=False) and after (a store holding the trial's point). The bench's data dir is a fresh
temporary one: no calibration or measured peak of an earlier run takes part. Both with the short real
calibration runs allowed (calibrate=True, the default on this CPU) and without (calibrate=False,
the uncalibrated default overhead). Relative error = (estimate - measured) / measured; "noise" is
the spread of the 3 runs at B over their median.

Largest batch: with the host memory capped (margin 0, as bench/estimate_accuracy.py), the largest
batch before and after the trial's point, calibrated and not; each answer after the point is run 3
times, and it fits when the median stays under the cap (every run is kept in the JSON).
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
    cap_bytes: int  # the host memory the largest batch must fit (bench/estimate_accuracy.py's caps)


CASES = [
    Case("mlp", {}, "fp32", "adamw", 1024, 4096, int(1.5 * GB)),
    Case("resnet18", {"image_size": 64}, "fp32", "adamw", 32, 128, int(1.5 * GB)),
    Case("gpt2-small", {"seq_len": 64}, "fp32", "sgd-momentum", 2, 8, int(2.5 * GB)),
    Case("tiny-gpt2", {}, "fp32", "adamw", 64, 256, int(0.3 * GB)),
]


def _rss(pool: ThreadPoolExecutor, c: Case, batch: int, runs: int) -> list[int]:
    from advisor.measure import MeasureRequest, measure

    req = MeasureRequest(workload=c.workload, workload_args=c.args, batch_size=batch, precision=c.precision,
                         optimizer=c.optimizer, mode="rss")
    return [int(f.result().rss_delta_bytes) for f in [pool.submit(measure, req) for _ in range(runs)]]


def _estimate(c: Case, batch: int, calibrate: bool, measured, hardware: Any = "cpu"):
    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory

    return estimate_memory(c.workload, hardware,
                           EstimateRequest(batch_size=batch, precision=c.precision, optimizer=c.optimizer),
                           EstimateOptions(calibrate=calibrate, margin=None if hardware == "cpu" else 0.0,
                                           measured=measured),
                           workload_args=c.args)


def _max_batch(c: Case, pool: ThreadPoolExecutor, calibrate: bool, store) -> dict[str, Any]:
    """The largest batch under the cap before and after the point in `store`; the one after, run 3 times."""
    from advisor.hardware import get_hardware

    hw = get_hardware("cpu").model_copy(update={"host_memory_bytes": c.cap_bytes})
    before = _estimate(c, c.target_batch, calibrate, False, hw).max_batch_size
    after = _estimate(c, c.target_batch, calibrate, store, hw).max_batch_size
    runs = _rss(pool, c, after, 3) if after else []
    return {"before": before, "after": after, "after_runs": runs,
            "after_fits": bool(runs) and statistics.median(runs) <= c.cap_bytes}


def _trial(c: Case):
    """The measured trial: `probes.run_trial` at batch A with record_peak='always', which runs docs/design.md's
    protocol once in a fresh process after the trial and keeps it (probes/protocol.py); the point it kept."""
    from advisor.peaks import default_peaks
    from advisor.trial import TrialBudget
    from probes.runner import run_trial

    budget = TrialBudget(warmup_steps=2, min_steps=3, min_time_s=0.0, settle_s=0, record_peak="always")
    result = run_trial(c.workload, {"batch_size": c.trial_batch, "precision": c.precision, "optimizer": c.optimizer},
                       hardware="cpu", workload_args=c.args, budget=budget)
    if not result.ok or result.protocol_peak_bytes is None:
        raise SystemExit(f"{c.workload}: the trial kept no peak: {result.status.value} {result.error or result.notes}")
    store = default_peaks()
    [point] = [p for p in store.points(_key(c)) if p.batch_size == c.trial_batch]
    return result, point


def _key(c: Case) -> str:
    from advisor.estimate.model import EstimateRequest
    from advisor.fingerprint import workload_fingerprint
    from advisor.hardware import get_hardware
    from advisor.peaks import request_key
    from advisor.workload import load_workload

    req = EstimateRequest(batch_size=c.trial_batch, precision=c.precision, optimizer=c.optimizer)
    return request_key(workload_fingerprint(load_workload(c.workload, c.args)), get_hardware("cpu"), req, "none",
                       "cpu_rss")


def run_case(c: Case, pool: ThreadPoolExecutor, maxbatch: bool) -> dict[str, Any]:
    from advisor.peaks import JsonlPeaks

    t0 = time.perf_counter()
    result, point = _trial(c)
    target_runs = _rss(pool, c, c.target_batch, 3)
    real = int(statistics.median(target_runs))
    rec: dict[str, Any] = {"workload": c.workload, "workload_args": c.args, "precision": c.precision,
                           "optimizer": c.optimizer, "trial_batch": c.trial_batch, "target_batch": c.target_batch,
                           "cap_bytes": c.cap_bytes, "trial_rss_bytes": point.peak_bytes,
                           "trial_rank_rss_bytes": result.peak_memory_bytes, "trial_wall_s": result.wall_s,
                           "target_rss_runs": target_runs, "target_rss_bytes": real,
                           "target_noise": (max(target_runs) - min(target_runs)) / real}
    for calibrate in (True, False):
        with tempfile.TemporaryDirectory(prefix="advisor-peaks-") as tmp:
            store = JsonlPeaks(tmp)  # the trial's point alone (a calibration adds its runs: they count once)
            store.add(point)
            before = _estimate(c, c.target_batch, calibrate, False)
            at_trial = _estimate(c, c.trial_batch, calibrate, False)
            after = _estimate(c, c.target_batch, calibrate, store)
            tag = "calibrated" if calibrate else "uncalibrated"
            rec[tag] = {"before_bytes": before.total_bytes, "after_bytes": after.total_bytes,
                        "predicted_at_trial_bytes": at_trial.total_bytes, "refined_by": after.refined_by,
                        "before_err": (before.total_bytes - real) / real,
                        "after_err": (after.total_bytes - real) / real,
                        "notes": after.notes}
            if maxbatch:
                rec[tag]["max_batch"] = _max_batch(c, pool, calibrate, store)
    rec["seconds"] = time.perf_counter() - t0
    return rec


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def markdown(results: dict[str, Any]) -> str:
    m = results["meta"]
    cpu = f"{m['cpu']}, " if m.get("cpu") else ""
    lines = [f"Run {m['started']} ({cpu}{m['cpu_count']} CPUs, torch {m['torch']}, advisor git {m['git']}), "
             f"load average {m['load_avg_start']}.", "",
             "| workload | prec | opt | trial batch | trial's rank RSS GB | its protocol run GB (kept) | target batch "
             "| real RSS GB (median of 3) | noise | calibrated: before | after | uncalibrated: before | after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["cases"]:
        cal, unc = r["calibrated"], r["uncalibrated"]
        lines.append(f"| {_name(r)} | {r['precision']} | {r['optimizer']} | "
                     f"{r['trial_batch']} | {_gb(r.get('trial_rank_rss_bytes'))} | {r['trial_rss_bytes'] / GB:.3f} | "
                     f"{r['target_batch']} | "
                     f"{r['target_rss_bytes'] / GB:.3f} | {r['target_noise'] * 100:.1f}% | {_pct(cal['before_err'])} | "
                     f"{_pct(cal['after_err'])} | {_pct(unc['before_err'])} | {_pct(unc['after_err'])} |")
    rows = [r for r in results["cases"] if "max_batch" in r["calibrated"]]
    if rows:
        lines += ["", "Largest batch under the cap (margin 0), before and after the trial's point; the answer after "
                  "it run 3 times (GB, median first):", "",
                  "| workload | cap GB | calibrated: before | after | its runs | fits | uncalibrated: before | after | "
                  "its runs | fits |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            cells = []
            for tag in ("calibrated", "uncalibrated"):
                mb = r[tag]["max_batch"]
                runs = sorted(mb["after_runs"])
                shown = (f"{statistics.median(runs) / GB:.3f} ({', '.join(f'{x / GB:.3f}' for x in runs)})"
                         if runs else "-")
                cells += [str(mb["before"]), str(mb["after"]), shown, "yes" if mb["after_fits"] else "NO"]
            lines.append(f"| {_name(r)} | {r['cap_bytes'] / GB:.2f} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def _gb(n: int | None) -> str:
    return "-" if n is None else f"{n / GB:.3f}"


def _name(r: dict[str, Any]) -> str:
    args = ",".join(f"{k}={v}" for k, v in r["workload_args"].items())
    return f"{r['workload']}{f' ({args})' if args else ''}"


def _git() -> str:
    import subprocess

    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "advisor", "probes"],
                           capture_output=True, text=True).stdout.strip()
    return (out.stdout.strip() or "unknown") + ("+changes" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "calibration.json")
    ap.add_argument("--only", default=None, help="comma-separated workload names")
    ap.add_argument("--skip", default="", help="'maxbatch' leaves out the largest-batch part")
    args = ap.parse_args(argv)
    data_dir = tempfile.mkdtemp(prefix="advisor-calbench-")
    os.environ["ADVISOR_DATA_DIR"] = data_dir
    try:
        return _main(args)
    finally:
        import shutil

        shutil.rmtree(data_dir, ignore_errors=True)


def _main(args: argparse.Namespace) -> int:
    import logging

    import torch

    from advisor.hardware.sysinfo import cpu_model_name

    logging.getLogger("advisor").setLevel(logging.ERROR)
    cases = [c for c in CASES if not args.only or c.workload in args.only.split(",")]
    results: dict[str, Any] = {"meta": {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
                                        "cpu": cpu_model_name(), "cpu_count": os.cpu_count(),
                                        "torch": torch.__version__, "git": _git(),
                                        "load_avg_start": [round(x, 1) for x in os.getloadavg()]}, "cases": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=2) as pool:
        for c in cases:
            rec = run_case(c, pool, "maxbatch" not in args.skip.split(","))
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

#!/usr/bin/env python
"""Offline: the CPU resident-set model against a time-resolved variant, on the same calibration runs.

    .venv/bin/python bench/resident_models.py vit-b16:fp32:adamw:16 mlp:fp32:adamw:4096 ...

A (the estimator's, advisor/estimate/overhead.py; up to session 17: persistent peak + s x heap-served
transient peak + mapped transient peak + i; since session 18 the mapped term is what the mapped
allocations add to the persistent bytes of their own moments, bench/mapped_moments.py).
B: max over the step of persistent(t) + s x heap(t) + mapped(t), + i: the two peaks need not
coincide, and freed activations' heap memory can hold later gradients. Both are fitted on one calibration's runs (calibrate_cpu: real runs, minutes per case; B by a grid over s with
calibrate._fit's prior), and compared with the accuracy grid's measured RSS at the case's batch
(bench/results/accuracy.json, median of 3). One JSON line per case. Not a benchmark of a goal: a
tool for deciding the resident-set model (bench/BENCHMARKS.calibration.md, "Session 11").
"""
import json
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from advisor.estimate.estimator import _batch_model, _make_request
from advisor.estimate.calibrate import RUN_NOISE, SLOPE_PRIOR_MEAN, SLOPE_PRIOR_SD, calibrate_cpu
from advisor.estimate.evaluator import Evaluator
from advisor.estimate.strategy import mmap_from, scaled_curve, split_over_step, touched_peak
from advisor.hardware import get_hardware
from advisor.workload import load_workload


def regress(req, bm, b, s, ratio, threshold=None):
    """B's regressor at batch b for slope s: the step's peak of persistent + s x heap + mapped (bytes),
    in a run with this glibc mmap threshold (None: the default)."""
    tr = bm.at(b)
    P, H, M = split_over_step(scaled_curve(req, tr, 1), tr.untouched, mmap_from(threshold))
    M = np.maximum(M, 0)
    return float((P + s * (H + ratio * (H + M)) + M).max())


def fitB(req, bm, runs, ratio):
    """(slope, intercept) of B over the runs: calibrate._fit's objective, by a grid over the slope."""
    best = None
    res = np.array([r for _, r, _ in runs], float)
    noise_var = (RUN_NOISE * float(np.median(res))) ** 2
    for s in np.arange(0.0, 2.51, 0.01):
        R = np.array([regress(req, bm, b, s, ratio, t) for b, _, t in runs])
        i = float(np.mean(res - R))
        sse = float(((res - R - i) ** 2).sum())
        obj = sse / noise_var + ((s - SLOPE_PRIOR_MEAN) / SLOPE_PRIOR_SD) ** 2
        if best is None or obj < best[0]:
            best = (obj, s, i)
    return best[1], best[2]

def main(specs: list[str]) -> None:
    acc = json.loads((ROOT / "bench" / "results" / "accuracy.json").read_text())["cases"]
    hw = get_hardware("cpu")
    for spec in specs:
        name, prec, opt, batch = spec.split(":")
        b = int(batch)
        case = next(c for c in acc if (c["workload"], c["precision"], c["optimizer"], c["batch_size"]) == (name, prec, opt, b))
        args = case["workload_args"]
        wl = load_workload(name, args)
        req = _make_request(hw, b, precision=prec, optimizer=opt, strategy="single", checkpointing=False, fused_backward=False,
                            offload_optimizer=False, offload_params=False, optimizer_impl=None)
        bm = _batch_model(wl, req, cpu=True)
        calib, chosen = calibrate_cpu(name, args, req, bm)
        A = Evaluator(hw, req, chosen, calib).predicted_total(b)
        s, i = fitB(req, chosen, calib.rss, calib.hidden_ratio)
        tr = chosen.at(b)
        B = max(regress(req, chosen, b, s, calib.hidden_ratio) + i, touched_peak(scaled_curve(req, tr, 1), tr.untouched))
        real = statistics.median(case["rss_runs"])
        print(json.dumps({"case": spec, "runs": calib.rss, "A": {"slope": calib.slope, "icpt": calib.intercept / 2**20,
              "pred": A, "err": (A - real) / real}, "B": {"slope": s, "icpt": i / 2**20, "pred": B, "err": (B - real) / real},
              "real": real, "grid_err": case["errors"]["ours_vs_rss"]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

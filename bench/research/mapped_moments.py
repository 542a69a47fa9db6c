#!/usr/bin/env python
"""Offline: where mapped allocations meet the long-lived bytes, on the same calibration runs and targets.

    .venv/bin/python bench/research/mapped_moments.py [--out FILE.jsonl] CASE [CASE ...]
    CASE = workload:precision:optimizer:batch[:key=value,...]   e.g. resnet18:fp32:sgd-momentum:32:image_size=112

glibc maps a request of 32 MiB and up on its own and unmaps it when freed, so such a transient
allocation is resident only while it lives. Per case, one calibration as the estimator runs it
(calibrate_cpu: real runs at up to half the batch) and 3 fresh-process runs of docs/design.md's CPU
protocol at the batch, in this process's data dir; both resident-set models are fitted on the same runs
(fit.fit_line) and compared with the runs' median:
- `peaks`: persistent peak + mapped transient peak + slope x heap-served transient peak + intercept
  (the two peaks added wherever they fall in the step);
- `moments`: max over the step of persistent(t) + mapped(t), + slope x heap-served peak + intercept
  (terms.resident_parts: the estimator's model).
One JSON line per case (bench/results/archive/mapped_moments.jsonl). A tool for deciding the resident-set model,
not a benchmark of a goal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from advisor.estimate.estimator import _batch_model  # noqa: E402
from advisor.estimate.evaluator import Evaluator  # noqa: E402
from advisor.estimate.model import EstimateRequest  # noqa: E402
from advisor.estimate.resident import calibrate as C  # noqa: E402
from advisor.estimate.resident.fit import fit_line  # noqa: E402
from advisor.estimate.resident.terms import mmap_from, resident_parts, touched_peak  # noqa: E402
from advisor.estimate.strategy import scaled_curve  # noqa: E402
from advisor.hardware import get_hardware  # noqa: E402
from advisor.workload import load_workload  # noqa: E402


def parse_case(case: str) -> tuple[str, str, str, int, dict]:
    parts = case.split(":")
    if parts[0].endswith(".py"):  # a workload file's spec keeps its own colon: file.py:build
        parts = [f"{parts[0]}:{parts[1]}", *parts[2:]]
    name, prec, opt, batch, *rest = parts
    args = {}
    for kv in (rest[0].split(",") if rest else []):
        k, v = kv.split("=")
        args[k] = int(v) if v.isdigit() else v
    return name, prec, opt, int(batch), args


def peaks_model(req, bm, ratio: float, b: int, threshold=None) -> tuple[int, int, float]:
    """(persistent + mapped peaks, heap-served transient peak, kernels' hidden buffers) of the `peaks`
    model at batch b (bytes)."""
    tr = bm.at(b)
    p, h, m, _ = resident_parts(scaled_curve(req, tr, 1), tr.synthetic, tr.untouched, mmap_from(threshold))
    return p + m, h, ratio * (h + m)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    hw = get_hardware("local")
    for case in a.cases:
        spec, prec, opt, b, args = parse_case(case)
        req = EstimateRequest.of(b, precision=prec, optimizer=opt, strategy="single", checkpointing=False,
                                 fused_backward=False, offload_optimizer=False, offload_params=False,
                                 optimizer_impl=None)
        bm = _batch_model(load_workload(spec, args), req, cpu=True)
        calib, chosen = C.calibrate_cpu(spec, args, req, bm)
        runs = C._run_parallel({i: C._request(spec, args, req, b, "rss") for i in range(3)})
        real = statistics.median(r.rss_delta_bytes for r in runs.values())
        moments = Evaluator(hw, req, chosen, calib).predicted_total(b)
        terms = [peaks_model(req, chosen, calib.hidden_ratio, x, t) for x, _, t in calib.rss]
        fit = fit_line([h + hid for _, h, hid in terms],
                       [r - base for (_, r, _), (base, _, _) in zip(calib.rss, terms)],
                     [r for _, r, _ in calib.rss])
        icpt, slope = fit.intercept, fit.slope
        base, heap, hidden = peaks_model(req, chosen, calib.hidden_ratio, b)
        tr = chosen.at(b)
        peaks = max(touched_peak(scaled_curve(req, tr, 1), tr.untouched) + hidden,
                    base + slope * (heap + hidden) + icpt)
        row = {"case": case, "calibration_runs": calib.rss, "hidden_ratio": calib.hidden_ratio,
               "runs_at_batch": sorted(r.rss_delta_bytes for r in runs.values()), "median": real,
               "peaks": {"bytes": int(peaks), "slope": round(slope, 3), "err": round((peaks - real) / real, 4)},
               "moments": {"bytes": int(moments), "slope": round(calib.slope, 3),
                           "err": round((moments - real) / real, 4)}}
        line = json.dumps(row)
        print(line, flush=True)
        if a.out:
            with a.out.open("a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()

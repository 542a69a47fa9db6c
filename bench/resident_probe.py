#!/usr/bin/env python
"""Offline: which transient term the CPU resident-set fit should multiply, on the same runs.

    ADVISOR_DATA_DIR=$(mktemp -d) .venv/bin/python bench/resident_probe.py collect \
        --cases bench/results/accuracy.json --min-batch 16 --out $TMP/probe.jsonl
    .venv/bin/python bench/resident_probe.py compare $TMP/probe.jsonl

`collect`, per case of an accuracy result file (from `--min-batch` up): one calibrated estimate
(`estimate_memory(..., calibrate=True, measured=False)`, so its own real runs at fractions of the
batch), each run's terms from the chosen batch model's trace (strategy.resident_terms under the mmap
threshold the run fixed), the terms at the batch, and three fresh real runs at the batch on this
machine (DESIGN.md's CPU protocol): one JSON line per case, appended as each case finishes.

`compare`: the resident set at the batch fitted as calibrate._fit does (the slope's prior, the
runs' noise), on each recorded calibration's runs, with the transient term taken as
- `peak`: the heap-served transient peak (the estimator's term up to session 22);
- `over`: the heap-served transient bytes over the persistent peak where they live beside it
  (strategy.resident_terms' last item; the estimator's term since session 23);
against the median of the three runs here. Kernels' hidden buffers join either term as the
estimator adds them. A tool for deciding the resident-set model (bench/BENCHMARKS.calibration.md,
"Session 23"), not a benchmark of a goal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from unittest import mock

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from advisor.estimate import calibrate, estimator  # noqa: E402
from advisor.estimate.strategy import mmap_from, peak_breakdown, resident_terms, scaled_curve  # noqa: E402
from advisor.measure import MeasureRequest, measure  # noqa: E402

REAL_RUNS = 3


def terms(req, bm, calib, b: int, threshold: int | None) -> dict[str, int]:
    """The batch model's resident-set terms at batch b, in a run with this mmap threshold (bytes)."""
    tr = bm.at(b)
    curve = scaled_curve(req, tr, 1)
    persistent, heap, mapped, over, above = resident_terms(curve, tr.synthetic, tr.untouched, mmap_from(threshold))
    return dict(persistent=persistent, heap=heap, mapped=mapped, over=over, above=above,
                allocated=peak_breakdown(curve)[0], hidden=calib.hidden(heap + mapped))


def collect(args) -> None:
    cases = [c for c in json.loads(Path(args.cases).read_text())["cases"] if c["batch_size"] >= args.min_batch]
    captured = {}
    real_calibrate = calibrate.calibrate_cpu

    def capture(spec, wargs, req, bm, *a, **k):
        calib, chosen = real_calibrate(spec, wargs, req, bm, *a, **k)
        captured["last"] = (req, calib, chosen)
        return calib, chosen

    with mock.patch.object(calibrate, "calibrate_cpu", capture):
        for c in cases:
            captured.clear()
            est = estimator.estimate_memory(c["workload"], "cpu", c["batch_size"], precision=c["precision"],
                                            optimizer=c["optimizer"], workload_args=c["workload_args"],
                                            calibrate=True, measured=False)
            if "last" not in captured:
                print(f"{c['key']}: no calibration ({est.notes})", flush=True)
                continue
            req, calib, bm = captured["last"]
            real = [measure(MeasureRequest(workload=c["workload"], workload_args=c["workload_args"],
                                           batch_size=c["batch_size"], precision=c["precision"],
                                           optimizer=c["optimizer"], mode="rss")).rss_delta_bytes
                    for _ in range(REAL_RUNS)]
            rec = dict(key=c["key"], batch=c["batch_size"], estimate=est.total_bytes, hidden_ratio=calib.hidden_ratio,
                       runs=[dict(batch=b, rss=r, threshold=t, **terms(req, bm, calib, b, t)) for b, r, t in calib.rss],
                       target=terms(req, bm, calib, c["batch_size"], None), real=real)
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"{c['key']}: estimate {est.total_bytes / statistics.median(real) - 1:+.3f} against the median of "
                  f"{REAL_RUNS} runs here", flush=True)


TERMS = {"peak": lambda t: t["heap"], "over": lambda t: t["above"]}


def predict(rec: dict, term: str) -> float:
    """The fitted resident set at the batch (bytes), as calibrate._fit_resident and Evaluator.at take it."""
    x = TERMS[term]
    runs, t = rec["runs"], rec["target"]
    transient = [x(r) + r["hidden"] for r in runs]
    extra = [r["rss"] - r["persistent"] - r["over"] for r in runs]
    intercept, slope, _ = calibrate._fit(transient, extra, [r["rss"] for r in runs])
    return t["persistent"] + t["over"] + intercept + slope * (x(t) + t["hidden"])


def compare(args) -> None:
    recs = [json.loads(line) for line in Path(args.probe).read_text().splitlines() if line.strip()]
    errors = {term: [] for term in TERMS}
    print(f"| case | runs (batch: MiB) | real here (MiB) | {' | '.join(TERMS)} |")
    print(f"|---|---|---|{'---|' * len(TERMS)}")
    for rec in recs:
        real = statistics.median(rec["real"])
        row = []
        for term in TERMS:
            e = predict(rec, term) / real - 1
            errors[term].append(e)
            row.append(f"{e:+.1%}")
        runs = ", ".join(f"{r['batch']}: {r['rss'] >> 20}" for r in rec["runs"])
        print(f"| {rec['key']} | {runs} | {', '.join(str(r >> 20) for r in rec['real'])} | {' | '.join(row)} |")
    for term, es in errors.items():
        a = np.abs(es)
        print(f"{term}: n {len(a)}, median |err| {np.median(a):.1%}, max {a.max():.1%}, over 12%: {int((a > 0.12).sum())}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--cases", required=True, help="an accuracy result file (bench/results/accuracy*.json)")
    c.add_argument("--min-batch", type=int, default=16)
    c.add_argument("--out", required=True)
    p = sub.add_parser("compare")
    p.add_argument("probe")
    args = ap.parse_args()
    collect(args) if args.cmd == "collect" else compare(args)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Offline: the CPU resident-set model's choices (its transient term, its uncalibrated default), on the same runs.

    ADVISOR_DATA_DIR=$(mktemp -d) .venv/bin/python bench/research/resident_probe.py collect \
        --cases bench/results/accuracy-fp32.json --min-batch 16 --out $TMP/probe.jsonl
    .venv/bin/python bench/research/resident_probe.py compare $TMP/probe.jsonl [MORE.jsonl ...] [--shares 0.1,0.2]

`collect`, per case of an accuracy result file (from `--min-batch` up): one calibrated estimate
(`estimate_memory(..., EstimateOptions(calibrate=True, measured=False))`, so its own real runs at fractions of the
batch), each run's terms from the chosen batch model's trace (terms.resident_terms under the mmap
threshold the run fixed), the terms at the batch, and three fresh real runs at the batch on this
machine (docs/design.md's CPU protocol): one JSON line per case, appended as each case finishes; cases
already in `--out` are skipped, so an interrupted collection goes on where it stopped.

`compare`: the resident set at the batch fitted as fit.fit_line does (the slope's prior, the
runs' noise), on each recorded calibration's runs, with the transient term taken as
- `peak`: the heap-served transient peak;
- `over`: the heap-served transient bytes over the persistent peak where they live beside it;
- `share`: `over`, and terms.UNREUSED_SHARE of the rest of the heap-served peak (terms.resident_terms'
  last item, the estimator's term); `--shares 0.1,0.2` adds a column per share;
against the median of the three runs here. Kernels' hidden buffers join each term as the
estimator adds them. A tool for deciding the resident-set model (bench/research/README.md), not a benchmark
of a goal. Records without `over_peak` (the four bench/results/archive/resident_probe-*.jsonl) hold the `over`
term as `above`; records collected by this version hold the estimator's term there and `over` as `over_peak`.

The uncalibrated default (resident.overhead.CPU_DEFAULT), fitted on presets outside the accuracy grid:

    ADVISOR_DATA_DIR=$(mktemp -d) .venv/bin/python bench/research/resident_probe.py collect --presets \
        --out $TMP/default.jsonl
    .venv/bin/python bench/research/resident_probe.py default $TMP/default.jsonl [--check OTHER.jsonl ...]

`collect --presets` collects the same records for DEFAULT_CASES; `default` fits each record's line
by plain least squares, without a prior, through all of its runs (the calibration's and the three at
the batch), with the term the uncalibrated estimate takes (`share`, no kernels' hidden buffers:
without runs there is no hidden ratio), and prints the medians of
the intercepts and slopes, and each default's error at the batch against the median of the three
runs there, on these records and on `--check`'s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from unittest import mock

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from advisor.estimate import EstimateOptions, EstimateRequest, estimator  # noqa: E402
from advisor.estimate.resident import calibrate  # noqa: E402
from advisor.estimate.resident.fit import fit_line  # noqa: E402
from advisor.estimate.resident.overhead import CPU_DEFAULT, CpuCalibration  # noqa: E402
from advisor.estimate.resident.overhead import MB as MiB  # noqa: E402
from advisor.estimate.resident.terms import UNREUSED_SHARE, heap_term, mmap_from, resident_terms  # noqa: E402
from advisor.estimate.strategy import peak_breakdown, scaled_curve  # noqa: E402
from advisor.measure import MeasureRequest, measure  # noqa: E402

REAL_RUNS = 3

# Presets outside the accuracy grid (bench/estimate_accuracy.py), at batches where the resident set
# is 0.15-0.5 GB here: the uncalibrated default's fitting set (`collect --presets`).
DEFAULT_CASES = [dict(key=f"{w}{a or ''}|{p}|{o}|b{b}", workload=w, workload_args=a, batch_size=b,
                      precision=p, optimizer=o)
                 for w, a, b in [("tiny-gpt2", {}, 256), ("tiny-resnet", {}, 1024),
                                 ("resnet18", {"image_size": 64}, 64), ("mlp", {"hidden": 1024}, 4096),
                                 ("tiny-lstm", {}, 512), ("tiny-unet", {}, 128),
                                 ("tiny-bert", {}, 128), ("tiny-vit", {}, 512), ("tiny-dlrm", {}, 16384),
                                 ("tiny-llama", {}, 128)]
                 for p, o in [("fp32", "adamw"), ("bf16", "sgd-momentum")]]


def terms(req, bm, calib, b: int, threshold: int | None) -> dict[str, int]:
    """The batch model's resident-set terms at batch b, in a run with this mmap threshold (bytes)."""
    tr = bm.at(b)
    curve = scaled_curve(req, tr, 1)
    persistent, heap, mapped, over, above = resident_terms(curve, tr.synthetic, tr.untouched, mmap_from(threshold))
    over_peak = resident_terms(curve, tr.synthetic, tr.untouched, mmap_from(threshold), unreused_share=0)[-1]
    return dict(persistent=persistent, heap=heap, mapped=mapped, over=over, above=above, over_peak=over_peak,
                allocated=peak_breakdown(curve)[0], hidden=calib.hidden(heap + mapped))


def collect(args) -> None:
    cases = DEFAULT_CASES if args.presets else json.loads(Path(args.cases).read_text())["cases"]
    out = Path(args.out)
    done = {json.loads(line)["key"] for line in out.read_text().splitlines() if line.strip()} if out.exists() else set()
    cases = [c for c in cases if c["batch_size"] >= args.min_batch and args.match in c["key"] and c["key"] not in done]
    captured = {}
    real_calibrate = calibrate.calibrate_cpu

    def capture(spec, wargs, req, bm, *a, **k):
        calib, chosen = real_calibrate(spec, wargs, req, bm, *a, **k)
        captured["last"] = (req, calib, chosen)
        return calib, chosen

    with mock.patch.object(calibrate, "calibrate_cpu", capture):
        for c in cases:
            captured.clear()
            est = estimator.estimate_memory(c["workload"], "cpu",
                                            EstimateRequest(batch_size=c["batch_size"], precision=c["precision"],
                                                            optimizer=c["optimizer"]),
                                            EstimateOptions(calibrate=True, measured=False),
                                            workload_args=c["workload_args"])
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


def over_peak(t: dict) -> int:
    """The heap-served transient bytes over the persistent peak (bytes), from a record of either layout."""
    return t.get("over_peak", t["above"])


def shared(share: float):
    """The term with `share` of the heap-served peak under the persistent peak counted besides."""
    return lambda t: heap_term(t["heap"], over_peak(t), share)


TERMS = {"peak": lambda t: t["heap"], "over": over_peak, "share": shared(UNREUSED_SHARE)}


def predict(rec: dict, x) -> float:
    """The fitted resident set at the batch (bytes), as fit.fit_resident and Evaluator.at take it (the
    per-sample term included), with the transient term `x` of a run's terms."""
    runs, t = rec["runs"], rec["target"]
    transient = [x(r) + r["hidden"] for r in runs]
    extra = [r["rss"] - r["persistent"] - r["over"] for r in runs]
    fit = fit_line(transient, extra, [r["rss"] for r in runs], batches=[r["batch"] for r in runs])
    return (t["persistent"] + t["over"] + fit.intercept + fit.slope * (x(t) + t["hidden"])
            + fit.per_sample * rec["batch"])


def compare(args) -> None:
    recs = [line for path in args.probe for line in _records(path)]
    terms = {**TERMS, **{f"share {f:g}": shared(f) for f in args.shares}}
    errors = {term: [] for term in terms}
    print(f"| case | runs (batch: MiB) | real here (MiB) | {' | '.join(terms)} |")
    print(f"|---|---|---|{'---|' * len(terms)}")
    for rec in recs:
        real = statistics.median(rec["real"])
        row = []
        for term, x in terms.items():
            e = predict(rec, x) / real - 1
            errors[term].append(e)
            row.append(f"{e:+.1%}")
        runs = ", ".join(f"{r['batch']}: {r['rss'] >> 20}" for r in rec["runs"])
        print(f"| {rec['key']} | {runs} | {', '.join(str(r >> 20) for r in rec['real'])} | {' | '.join(row)} |")
    for term, es in errors.items():
        a = np.abs(es)
        print(f"{term}: n {len(a)}, median |err| {np.median(a):.1%}, max {a.max():.1%}, over 12%: "
              f"{int((a > 0.12).sum())}")


def _records(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def fit_free(rec: dict) -> tuple[float, float | None]:
    """(intercept bytes, slope) of extra = intercept + slope x the share term through all of a record's runs,
    by plain least squares; (0, None) where the runs' term spans too little to say (`default` then
    takes the intercept under the other records' median slope)."""
    x, y = _points(rec)
    if np.ptp(x) < 0.05 * max(float(np.median([r["rss"] for r in rec["runs"]])), 1.0):
        return 0.0, None
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def _points(rec: dict) -> tuple[np.ndarray, np.ndarray]:
    """(share term, resident - persistent - over) of a record's runs, the calibration's and the batch's (bytes)."""
    t, x = rec["target"], TERMS["share"]
    pts = [(x(r), r["rss"] - r["persistent"] - r["over"]) for r in rec["runs"]]
    pts += [(x(t), r - t["persistent"] - t["over"]) for r in rec["real"]]
    return tuple(np.array(pts, float).T)


def uncalibrated_error(rec: dict, cal: CpuCalibration) -> float:
    """The uncalibrated estimate's resident set at the record's batch under `cal`, against the median of
    its three runs there (signed share)."""
    t = rec["target"]
    return cal.resident(t["persistent"], TERMS["share"](t), t["over"]) / statistics.median(rec["real"]) - 1


def default(args) -> None:
    recs = _records(args.probe)
    fits = {rec["key"]: fit_free(rec) for rec in recs}
    slopes = [s for _, s in fits.values() if s is not None]
    for rec in recs:  # too little span for a slope: the intercept under the others' median slope
        if fits[rec["key"]][1] is None:
            x, y = _points(rec)
            fits[rec["key"]] = (float(np.mean(y - np.median(slopes) * x)), None)
    intercepts = [i for i, _ in fits.values()]
    refit = CpuCalibration(intercept=float(np.median(intercepts)), slope=float(np.median(slopes)))
    print(f"{len(recs)} records; intercepts {min(intercepts) / MiB:.0f}-{max(intercepts) / MiB:.0f} MiB, "
          f"slopes {min(slopes):.2f}-{max(slopes):.2f} ({len(slopes)} spanning enough to fit one)")
    print(f"medians: {refit.formula()}   current default: {CPU_DEFAULT.formula()}")
    defaults = {"current": CPU_DEFAULT, "medians": refit}
    print(f"| case | free fit | real here (MiB) | {' | '.join(defaults)} |")
    print(f"|---|---|---|{'---|' * len(defaults)}")
    for rec in recs:
        i, s = fits[rec["key"]]
        row = " | ".join(f"{uncalibrated_error(rec, cal):+.1%}" for cal in defaults.values())
        print(f"| {rec['key']} | {'-' if s is None else f'{s:.2f}'} x + {i / MiB:.0f} MiB "
              f"| {statistics.median(rec['real']) / MiB:.0f} | {row} |")
    sets = {"fitting set": recs}
    for path in args.check:
        sets[path] = _records(path)
    for label, rs in sets.items():
        for name, cal in defaults.items():
            es = np.array([uncalibrated_error(rec, cal) for rec in rs])
            print(f"{label}, {name}: n {len(es)}, median |err| {np.median(np.abs(es)):.1%}, "
                  f"max {np.abs(es).max():.1%}, median signed {np.median(es):+.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--cases", help="an accuracy result file (bench/results/accuracy*.json)")
    src.add_argument("--presets", action="store_true", help="DEFAULT_CASES: the uncalibrated default's fitting set")
    c.add_argument("--min-batch", type=int, default=16)
    c.add_argument("--match", default="", help="only the cases whose key holds this")
    c.add_argument("--out", required=True)
    p = sub.add_parser("compare")
    p.add_argument("probe", nargs="+", help="collected records (JSON lines), one file or more")
    p.add_argument("--shares", type=lambda v: [float(x) for x in v.split(",")], default=[],
                   help="comma-separated shares to add a `share` column for each, e.g. 0.1,0.2,0.3")
    d = sub.add_parser("default")
    d.add_argument("probe")
    d.add_argument("--check", nargs="*", default=[], help="other collected records to check the defaults on")
    args = ap.parse_args()
    {"collect": collect, "compare": compare, "default": default}[args.cmd](args)


if __name__ == "__main__":
    main()

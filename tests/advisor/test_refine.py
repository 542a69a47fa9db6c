"""Measured peaks refine the estimate: the pure fit, and against real runs (advisor.measure).

Real runs use tiny-gpt2 (activation-heavy at these batches, so the peak grows ~0.6 MB per sample)
with the uncalibrated estimator (calibrate=False), whose resident-set overhead is a default from
other models: the measured peaks must correct it.
"""

from __future__ import annotations

import re
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from advisor.estimate import EstimateOptions, estimate_memory
from advisor.estimate.model import EstimateRequest
from advisor.estimate.refine import CAUTION, refine
from advisor.estimate.resident.calibration import UNREPEATED_NOISE
from advisor.estimate.resident.fit import SLOPE_PRIOR_MEAN, SLOPE_PRIOR_SD
from advisor.estimate.resident.overhead import CPU_DEFAULT, CpuCalibration
from advisor.hardware import get_hardware
from advisor.measure import MeasureRequest, measure
from advisor.peaks import JsonlPeaks, record_measured_peak
from advisor.workload import load_workload

MB = 1_000_000
MiB = 1 << 20


# --- the pure fit -----------------------------------------------------------------------------

def test_two_batch_sizes_fit_an_affine_curve_that_replaces_the_estimate() -> None:
    r = refine([(10, 300 * MB), (30, 500 * MB), (20, 402 * MB)], predicted=lambda b: 0)
    assert r.affine and r.points == 3 and r.batches == (10, 20, 30)
    assert r.slope == pytest.approx(10 * MB, rel=1e-3)
    assert r.total(40, lambda b: 0) == pytest.approx(600.7 * MB, rel=1e-3)


def test_one_batch_size_shifts_the_estimate_by_the_residual() -> None:
    predicted = lambda b: 100 * MB + 2 * MB * b  # noqa: E731
    r = refine([(10, 150 * MB)], predicted)
    assert not r.affine and r.shift == pytest.approx(30 * MB)
    assert r.total(50, predicted) == 230 * MB
    assert "shifted by +29 MiB" in r.note() and "refined by 1 measured peak(s)" in r.note()


def test_negative_slope_is_refused_and_falls_back_to_the_mean_residual() -> None:
    predicted = lambda b: 100 * MB  # noqa: E731
    r = refine([(10, 130 * MB), (20, 110 * MB)], predicted)
    assert not r.affine and r.refused_slope < 0
    assert r.total(40, predicted) == 120 * MB
    assert "negative" in r.note()


def test_no_points_no_refinement() -> None:
    assert refine([], lambda b: 1) is None


# --- the estimator consults the store -----------------------------------------------------------

def test_estimate_uses_only_points_of_its_own_configuration(tmp_path: Path) -> None:
    store = JsonlPeaks(tmp_path)
    wl, hw = load_workload("tiny-mlp"), get_hardware("cpu")
    base = estimate_memory("tiny-mlp", "cpu", EstimateRequest(batch_size=64),
                           EstimateOptions(calibrate=False, measured=store))
    assert base.refined_by == 0
    record_measured_peak(wl, hw, base.request, "none", base.total_bytes + 40 * MB, "cpu_rss", base.total_bytes,
                         store=store)
    other = estimate_memory("tiny-mlp", "cpu", EstimateRequest(batch_size=64, precision="bf16"),
                            EstimateOptions(calibrate=False, measured=store))
    assert other.refined_by == 0  # another precision: another key
    compiled = estimate_memory("tiny-mlp", "cpu", EstimateRequest(batch_size=64),
                               EstimateOptions(calibrate=False, measured=store, compile_mode="default"))
    assert compiled.refined_by == 0
    ref = estimate_memory("tiny-mlp", "cpu", EstimateRequest(batch_size=64),
                          EstimateOptions(calibrate=False, measured=store))
    assert ref.refined_by == 1 and ref.total_bytes == base.total_bytes + 40 * MB
    assert sum(ref.breakdown.model_dump().values()) == ref.total_bytes
    assert any("refined by 1 measured peak(s)" in n for n in ref.notes)
    off = estimate_memory("tiny-mlp", "cpu", EstimateRequest(batch_size=64),
                          EstimateOptions(calibrate=False, measured=False))
    assert off.refined_by == 0 and off.total_bytes == base.total_bytes
    nominal = estimate_memory("tiny-mlp", "cpu:1", EstimateRequest(batch_size=64),
                              EstimateOptions(calibrate=False, measured=store))  # not this host
    assert nominal.refined_by == 0


# --- synthetic recorded points: deterministic --------------------------------------------------

def _resident_parts(workload: str, batches: tuple[int, ...]) -> dict[int, tuple[int, int, int]]:
    """(persistent, heap-served transient over the persistent peak, mapped transient over the persistent
    peak) bytes at each batch: the terms of the CPU resident-set model the estimator fits
    (resident.overhead.CpuCalibration), from its own traces (terms.resident_terms)."""
    from advisor.estimate.estimator import _batch_model
    from advisor.estimate.resident.terms import resident_terms
    from advisor.estimate.strategy import scaled_curve

    req = EstimateRequest(batch_size=batches[0])
    bm = _batch_model(load_workload(workload), req, cpu=True)
    parts = {b: resident_terms(scaled_curve(req, bm.at(b), 1), bm.at(b).synthetic, bm.at(b).untouched) for b in batches}
    return {b: (p, above, over) for b, (p, _, _, over, above) in parts.items()}


def test_cpu_measured_peaks_join_the_resident_set_fit_and_give_its_largest_batch(tmp_path: Path) -> None:
    # Two recorded resident sets drawn from a known model (slope 0.7, 60 MiB) far from the default
    # (CPU_DEFAULT), spanning far past their noise: the fit recovers that model (the prior still pulls
    # the slope by a hundredth or so), and the largest batch is where it meets usable memory.
    # Deterministic stand-ins for two trials.
    store, wl = JsonlPeaks(tmp_path), load_workload("tiny-gpt2")
    true = CpuCalibration(intercept=60 * MiB, slope=0.7)
    parts = _resident_parts("tiny-gpt2", (32, 256, 300, *range(500, 601)))
    resident = {b: true.resident(p, h, m) for b, (p, h, m) in parts.items()}
    for b in (32, 256):
        record_measured_peak(wl, get_hardware("cpu"), EstimateRequest(batch_size=b), "none", resident[b], "cpu_rss",
                             None, store=store)
    hw = get_hardware("cpu").model_copy(update={"host_memory_bytes": resident[600]})
    est = estimate_memory("tiny-gpt2", hw, EstimateRequest(batch_size=300),
                          EstimateOptions(calibrate=False, margin=0.0, measured=store))
    assert est.refined_by == 2 and not est.calibrated
    assert est.total_bytes == pytest.approx(resident[300], rel=0.01)
    note = next(n for n in est.notes if "refined by 2 measured peak(s)" in n)
    slope, intercept = re.search(r"persistent \+ ([\d.]+) x transient \+ (\d+) MiB", note).groups()
    assert float(slope) == pytest.approx(0.7, abs=0.02) and int(intercept) == pytest.approx(60, abs=2), note
    # The recovered model meets the cap at 600, and with a run's noise at its resident set kept clear
    # (UNREPEATED_NOISE, the least share kept) a little below; the cautious slope, two posterior
    # SDs steeper, is barely steeper where the points span far past their noise, so the answer stays
    # near that.
    steep = next(n for n in est.notes if "posterior SDs steeper" in n)
    assert 0.70 < float(steep.split("steeper (")[1].split(")")[0]) < 0.8, steep
    clear = max(b for b in range(500, 601) if resident[b] * (1 + UNREPEATED_NOISE) <= resident[600])
    assert 0.95 * clear <= est.max_batch_size <= clear, (clear, est.max_batch_size)


def test_one_cpu_measured_peak_fixes_the_intercept_under_the_default_slope(tmp_path: Path) -> None:
    store, wl = JsonlPeaks(tmp_path), load_workload("tiny-gpt2")
    base64 = estimate_memory("tiny-gpt2", "cpu", EstimateRequest(batch_size=64),
                             EstimateOptions(calibrate=False, measured=store))
    base512 = estimate_memory("tiny-gpt2", "cpu", EstimateRequest(batch_size=512),
                              EstimateOptions(calibrate=False, measured=store))
    record_measured_peak(wl, get_hardware("cpu"), base64.request, "none", base64.total_bytes + 40 * MB, "cpu_rss",
                         base64.total_bytes, store=store)
    after64 = estimate_memory("tiny-gpt2", "cpu", EstimateRequest(batch_size=64),
                              EstimateOptions(calibrate=False, measured=store))
    after512 = estimate_memory("tiny-gpt2", "cpu", EstimateRequest(batch_size=512),
                               EstimateOptions(calibrate=False, measured=store))
    assert after64.total_bytes == pytest.approx(base64.total_bytes + 40 * MB, abs=2)  # the fit runs through the point
    assert after512.total_bytes - base512.total_bytes == pytest.approx(40 * MB, abs=2)  # same slope, new intercept
    assert any(f"{CPU_DEFAULT.slope:.2f} x transient + {(CPU_DEFAULT.intercept + 40 * MB) / MiB:.0f} MiB" in n
               for n in after512.notes), after512.notes
    # One batch size says nothing of the slope: the largest batch under a cap is solved with it
    # CAUTION prior SDs steeper too, through the point, and the smaller answer kept.
    hw = get_hardware("cpu").model_copy(update={"host_memory_bytes": after512.total_bytes})
    capped = estimate_memory("tiny-gpt2", hw, EstimateRequest(batch_size=64),
                             EstimateOptions(calibrate=False, margin=0.0, measured=store))
    steeper = CPU_DEFAULT.slope + CAUTION * SLOPE_PRIOR_SD
    assert any(f"posterior SDs steeper ({steeper:.2f})" in n for n in capped.notes), capped.notes
    assert 64 < capped.max_batch_size < 512  # 512 is where the fitted slope meets the cap


def test_a_cpu_measured_peak_weighs_like_one_calibration_run() -> None:
    # Three calibration runs on one line and a fourth point 60 MB above it: the fit moves by about a
    # quarter of that at the point, not all of it (a shift would move it by 60 MB everywhere).
    from advisor.estimate.estimator import _batch_model
    from advisor.estimate.resident.calibration import Calibration
    from advisor.estimate.resident.fit import with_measured_peaks

    req = EstimateRequest(batch_size=64)
    bm = _batch_model(load_workload("tiny-gpt2"), req, cpu=True)
    parts = _resident_parts("tiny-gpt2", (8, 16, 32))
    line = CpuCalibration(intercept=90 * MiB, slope=SLOPE_PRIOR_MEAN)
    runs = tuple((b, line.resident(*parts[b]), None) for b in (8, 16, 32))
    first = Calibration(intercept=90 * MiB, slope=SLOPE_PRIOR_MEAN, rss=runs, batches=(8, 16, 32))
    refit = with_measured_peaks(req, bm, first, ((16, runs[1][1] + 60 * MB, None),))
    assert refit.rss == runs + ((16, runs[1][1] + 60 * MB, None),) and refit.batches == (8, 16, 32)
    moved = refit.resident(*parts[16]) - line.resident(*parts[16])
    assert 10 * MB < moved < 20 * MB, moved
    assert refit.spread == pytest.approx(60 * MB - moved, rel=0.05)  # the largest batch keeps the stray clear


def test_cuda_measured_peaks_at_two_batch_sizes_give_an_affine_max_batch(tmp_path: Path) -> None:
    # CUDA peaks repeat exactly, so two points fix a line: it replaces the estimator's curve.
    store, wl = JsonlPeaks(tmp_path), load_workload("tiny-gpt2")
    hw = get_hardware("h100-sxm")
    points = {16: 2_000 * MB, 48: 2_600 * MB}  # 18.75 MB per sample
    for b, peak in points.items():
        record_measured_peak(wl, hw, EstimateRequest(batch_size=b), "none", peak, "cuda_reserved", None, store=store)
    est = estimate_memory("tiny-gpt2", hw, EstimateRequest(batch_size=48), EstimateOptions(measured=store))
    assert est.refined_by == 2 and est.predicts == "cuda_reserved"
    fit = lambda b: 2_000 * MB + 18.75 * MB * (b - 16)  # noqa: E731 - the line through the two points
    assert est.total_bytes == pytest.approx(fit(48), abs=1)
    m = est.max_batch_size  # where the line (plus the CUDA context outside it) meets usable memory
    assert fit(m) + est.runtime_bytes <= est.usable_bytes < fit(m + 1) + est.runtime_bytes, m


# --- against real runs ------------------------------------------------------------------------

def _rss(pool: ThreadPoolExecutor, batch: int, runs: int) -> list:
    req = MeasureRequest(workload="tiny-gpt2", batch_size=batch, mode="rss")
    return [pool.submit(measure, req) for _ in range(runs)]


def _median(futures: list) -> int:
    return int(statistics.median(f.result().rss_delta_bytes for f in futures))


def test_real_measured_peaks_refine_the_largest_batch_and_it_fits(tmp_path: Path) -> None:
    # Two real runs, as two trials give them, recorded; the largest batch under a cap beyond them
    # then really fits: the median of 3 real runs there stays under the cap.
    store, wl = JsonlPeaks(tmp_path), load_workload("tiny-gpt2")
    with ThreadPoolExecutor(max_workers=2) as pool:
        points = {b: _median(_rss(pool, b, 1)) for b in (32, 128)}
    cap = int(max(points.values()) * 1.5)
    hw = get_hardware("cpu").model_copy(update={"host_memory_bytes": cap})
    for b, peak in points.items():
        record_measured_peak(wl, hw, EstimateRequest(batch_size=b), "none", peak, "cpu_rss", None, store=store)
    est = estimate_memory("tiny-gpt2", hw, EstimateRequest(batch_size=128),
                          EstimateOptions(calibrate=False, margin=0.0, measured=store))
    assert est.refined_by == 2 and any("refined by 2 measured peak(s) at batch size(s) 32, 128" in n for n in est.notes)
    assert est.max_batch_size > 128
    with ThreadPoolExecutor(max_workers=2) as pool:
        real = _median(_rss(pool, est.max_batch_size, 3))
    # Two single runs are all it has, so the answer keeps UNREPEATED_NOISE of its own resident set
    # clear (calibration.Calibration.noise_share): with RUN_NOISE kept instead, the median of 3 here
    # is 0.7 MB to 1.7 MB (on an AMD host) over the cap.
    assert real <= cap, (real, cap, points, est.notes)

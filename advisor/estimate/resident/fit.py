"""The resident-set line fitted through runs: least squares with the slope drawn toward a prior."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from advisor.estimate.batchmodel import BatchModel
from advisor.estimate.model import EstimateRequest
from advisor.estimate.resident.calibration import RUN_NOISE, Calibration, Run
from advisor.estimate.resident.overhead import CPU_DEFAULT
from advisor.estimate.resident.terms import batch_terms, mmap_from

# Bounds on resident bytes per transient live byte: the fit extrapolates, and noise in a
# resident set must not turn into a wild slope.
SLOPE_BOUNDS = (0.5, 2.5)
# Where a calibration's runs say little of the slope, it is drawn toward this one: the median slope of
# calibrations (1.16 over the accuracy grid's 32 cases from batch 16 up). Not the uncalibrated default's
# (overhead.CPU_DEFAULT, fitted from an eighth of a batch to the batch itself): within a calibration's runs,
# which lie within a few times of each other, the resident set grows less per transient byte.
# Evidence: bench/research/resident_probe.py, bench/results/archive/resident_probe-grid.jsonl
SLOPE_PRIOR_MEAN = 1.15
# How far a workload's slope strays from the prior's: fitted slopes span 0.5-1.9 across presets.
SLOPE_PRIOR_SD = 0.35


def slope_precision(sxx: float, noise_var: float) -> float:
    """1 / variance of the resident-set slope's posterior: the runs' centred transient spread `sxx`
    (bytes^2) over their noise variance, plus the normal prior's (SLOPE_PRIOR_SD about its mean)."""
    return sxx / noise_var + 1.0 / SLOPE_PRIOR_SD ** 2


# Some models' resident set grows with the bytes each step allocates and frees (glibc keeps the freed chunks), far
# faster than their transient peak; the slope's prior is a mixture of the usual one and, with weight GROWTH_PRIOR, a
# broad one (GROWTH_SD). The fit blends the two fits by how likely the runs' own slope is under each (`growth_weight`),
# so that a slope near the switch does not jump between them.
# Evidence: bench/estimate_accuracy.py --set kinds, bench/results/accuracy-kinds-rerun.json
GROWTH_PRIOR = 0.1  # two of the kinds set's eight workloads (ckpt, moe) grow this way
GROWTH_SD = 5.0  # resident bytes per transient byte: ckpt's runs say 8-20


def growth_weight(free: float, prior: float, sxx: float, noise_var: float) -> float:
    """The weight (0-1) of the per-sample fit in `fit_line`: the posterior probability that the runs' own slope
    `free` (its variance noise_var / sxx) came from the broad prior (GROWTH_PRIOR, GROWTH_SD about `prior`) rather
    than the normal one (SLOPE_PRIOR_SD). Only where it is steeper than `prior`: a shallower slope stays drawn
    toward it and bounded, since the runs' heap may reuse more at larger batches, and an estimate under the
    resident set is the one that fails a run."""
    if free <= prior:
        return 0.0
    se2 = noise_var / sxx

    def density(sd2: float) -> float:
        return float(np.exp(-0.5 * (free - prior) ** 2 / sd2) / np.sqrt(sd2))

    narrow = (1 - GROWTH_PRIOR) * density(se2 + SLOPE_PRIOR_SD ** 2)
    broad = GROWTH_PRIOR * density(se2 + GROWTH_SD ** 2)
    return broad / (narrow + broad)


class Fit(NamedTuple):
    """A resident-set fit: extra = intercept + slope x transient + per_sample x batch (bytes)."""
    intercept: float
    slope: float
    spread: float  # the largest distance of a run from the fit (bytes)
    per_sample: float = 0.0


def fit_line(transient: list[int], extra: list[float], resident: list[int],
             prior: float = SLOPE_PRIOR_MEAN, batches: list[int] | None = None) -> Fit:
    """extra = intercept + slope x transient, by least squares with the slope drawn toward `prior` (the
    posterior mean under a normal prior on it): where the runs' transient bytes span little next to their
    noise, they say little about the slope, and three single runs would otherwise hand the extrapolation
    whatever slope their noise suggests. The noise is the larger of RUN_NOISE of the runs' resident set and
    what the runs stray from a free fit. Where their `batches` are given and the runs' own slope is steeper
    than the prior's, the fit blends in, by `growth_weight`, one that keeps the prior's slope for the
    transient bytes and fits the rest of the runs' growth per sample of the batch. Also the largest
    distance of a run from the fit (bytes): how far one run of this workload strays here."""
    x, y = np.asarray(transient, float), np.asarray(extra, float)
    xc, yc = x - x.mean(), y - y.mean()
    noise_var = (RUN_NOISE * float(np.median(resident))) ** 2
    sxx = float(xc @ xc)
    free = None  # the runs' own least-squares slope, where they can say one
    if len(x) > 2 and sxx > 0:
        free = float(xc @ yc) / sxx
        noise_var = max(noise_var, float(((yc - free * xc) ** 2).sum()) / (len(x) - 2))
    slope = (float(xc @ yc) / noise_var + prior / SLOPE_PRIOR_SD ** 2) / slope_precision(sxx, noise_var)
    slope = float(np.clip(slope, *SLOPE_BOUNDS))
    intercept, per_sample = float(np.mean(y - slope * x)), 0.0
    n = np.asarray(batches if batches is not None else [0] * len(x), float)
    w = growth_weight(free, prior, sxx, noise_var) if free is not None and np.ptp(n) > 0 else 0.0
    if w > 0:  # blend in the prior's slope with the rest of the growth per sample (least squares, at least 0)
        grows = max(0.0, float(np.polyfit(n, y - prior * x, 1)[0]))
        intercept = (1 - w) * intercept + w * float(np.mean(y - prior * x - grows * n))
        slope, per_sample = (1 - w) * slope + w * prior, w * grows
    rest = y - slope * x - per_sample * n - intercept
    return Fit(intercept, slope, float(np.abs(rest).max()), per_sample)


def fit_resident(req: EstimateRequest, bm: BatchModel, ratio: float, rss: tuple[Run, ...],
                 prior: float = SLOPE_PRIOR_MEAN) -> Fit:
    """resident - persistent = intercept + slope x transient (+ per_sample x batch) over the runs, each
    run's allocations split into heap-served and mapped at the size its glibc mapped from; the slope
    drawn toward `prior` (`fit_line`)."""
    split = [batch_terms(req, bm, b, mmap_from(t)) for b, _, t in rss]
    # kernels' hidden buffers join the heap-served part; mapped allocations count once, at their own moments
    heap = [int(above + ratio * (h + m)) for _, h, m, _, above in split]
    extra = [r - p - over for (_, r, _), (p, _, _, over, _) in zip(rss, split)]
    return fit_line(heap, extra, [r for _, r, _ in rss], prior, [b for b, _, _ in rss])


def with_measured_peaks(req: EstimateRequest, bm: BatchModel, first: Calibration | None,
                        points: tuple[Run, ...]) -> Calibration:
    """The resident-set fit again with measured peaks (Run: batch size, resident-set increase as
    docs/design.md's "what a measured peak means" has it, the glibc mmap threshold the run fixed or None for
    a trial) as more runs beside `first`'s, each weighing like one of them: a trial's resident set is one
    run, as noisy as any (identical runs differ by up to ~10%). Without a first calibration the points are
    the only runs: one fixes the intercept under the uncalibrated default's slope, more draw the slope
    toward it as their span allows (`fit_line`). No run is made here."""
    ratio = first.hidden_ratio if first is not None else 0.0
    rss = (first.rss if first is not None else ()) + tuple(points)
    prior = SLOPE_PRIOR_MEAN if first is not None else CPU_DEFAULT.slope
    return Calibration(**fit_resident(req, bm, ratio, rss, prior)._asdict(), hidden_ratio=ratio,
                       batches=tuple(sorted({b for b, _, _ in rss})),
                       used_real_traces=first.used_real_traces if first is not None else False, rss=rss,
                       replayed=first.replayed if first is not None else ())


def from_an_eighth(runs: tuple[Run, ...] | list[Run], batch: int) -> tuple[Run, ...]:
    """The runs from an eighth of `batch` up: those a resident-set fit for `batch` takes in beside
    runs nearer it (farther down, the heap reuses freed chunks otherwise; see calibrate.recalibrate_near)."""
    return tuple(p for p in runs if p[0] >= batch // 8)

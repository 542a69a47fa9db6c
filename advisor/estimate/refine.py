"""Refine the predicted peak with measured peaks of the same workload, device and configuration.

Pure: the measured (batch size, peak bytes) pairs come in, a refined estimate comes out. How they
refine it depends on how repeatable the measured quantity is.

CUDA (max_memory_allocated / reserved: identical runs give identical peaks). Peak memory is close
to affine in the batch size (parameters, gradients and optimizer state are constant; activations
and the memory that holds them grow linearly), so `refine`:
- points at two or more batch sizes: least squares total(b) = intercept + slope x b, which
  replaces the estimator's curve (its own slope included). A negative slope is refused (the points
  then disagree with each other, not with the estimator), and the points only shift the
  estimator's curve by their mean residual, as below.
- points at one batch size: the estimator's curve shifted by measured - predicted there. A shift
  rather than a scale because the estimator's batch dependence comes from traced tensor sizes,
  which match real allocations within about 1%; what it misses is mostly outside the tensors
  (allocator retention, workspaces), which barely depends on the batch. A scale would also
  multiply the exactly known parameter and optimizer-state bytes.

CPU (the resident set: identical runs differ by up to ~10%). One measured peak is one more
run of the resident-set model the estimator already fits (resident = persistent + slope x
transient + intercept, resident/overhead.py), not a truth to move the whole curve to: shifting the curve by
one run's residual carries its noise, and an error found at batch A, to every batch, where neither
is the same (the resident set is convex in the batch, and glibc maps large allocations on their
own). So measured resident sets join the calibration's runs in its fit, each weighing like one of
them, the slope drawn toward the default's by how little their span says
(resident.fit.with_measured_peaks); without calibration runs they fix the intercept under the
default's slope (one point) or fit both (points spanning more than their noise). Such a fit says
little about the slope far from the points, so the largest batch of an uncalibrated estimate is
also solved with the slope CAUTION posterior SDs steeper, pivoting on the points (`cautious`), and
the smaller answer kept: one trial at batch A must not send the next one to an OOM at 5 x A.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from advisor.estimate.resident.calibration import RUN_NOISE, Run
from advisor.estimate.resident.fit import slope_precision
from advisor.estimate.resident.overhead import CpuCalibration


@dataclass(frozen=True)
class Refinement:
    """total(b) from measured peaks; `points` says how many were used."""

    points: int
    batches: tuple[int, ...]  # the distinct measured batch sizes (samples)
    intercept: float | None = None  # bytes; with slope, the affine fit (None: shift the estimator's curve)
    slope: float | None = None  # bytes per sample
    shift: float = 0.0  # bytes added to the estimator's curve
    refused_slope: float | None = None  # a negative fitted slope that was refused (bytes per sample)

    @property
    def affine(self) -> bool:
        return self.slope is not None

    def total(self, b: int, predicted: Callable[[int], int]) -> int:
        """Refined total at batch b; `predicted(b)` is the estimator's own total (bytes)."""
        if self.affine:
            return int(round(self.intercept + self.slope * b))
        return int(round(predicted(b) + self.shift))

    def note(self) -> str:
        n = f"refined by {self.points} measured peak(s) at batch size(s) {', '.join(map(str, self.batches))}"
        if self.affine:
            return (f"{n}: total = {self.intercept / 2**20:.0f} MiB + {self.slope / 2**20:.2f} MiB x batch "
                    "(least squares)")
        why = "" if self.refused_slope is None else (
            f"; their fitted slope {self.refused_slope / 2**20:.2f} MiB/sample is negative (noise), so refused")
        return f"{n}: the estimate shifted by {self.shift / 2**20:+.0f} MiB{why}"


def refine(points: list[tuple[int, int]], predicted: Callable[[int], int]) -> Refinement | None:
    """Fit (batch size, measured peak bytes) pairs; None without points. `predicted(b)`: the
    estimator's total at b (bytes), consulted only at the measured batch sizes."""
    if not points:
        return None
    b = np.asarray([p[0] for p in points], float)
    y = np.asarray([p[1] for p in points], float)
    batches = tuple(sorted({int(x) for x in b}))
    refused = None
    if len(batches) >= 2:
        slope, intercept = np.polyfit(b, y, 1)
        if slope >= 0:
            return Refinement(points=len(points), batches=batches, intercept=float(intercept), slope=float(slope))
        refused = float(slope)
    residual = float(np.mean([yi - predicted(int(bi)) for bi, yi in zip(b, y)]))
    return Refinement(points=len(points), batches=batches, shift=residual, refused_slope=refused)


def resident_note(points: list[Run], calib: CpuCalibration, calibrated: bool) -> str:
    """What measured resident sets did to a CPU estimate, in one line."""
    batches = ", ".join(map(str, sorted({b for b, *_ in points})))
    how = ("joined the calibration runs in the resident-set fit" if calibrated
           else "fitted under the default slope's prior")
    return (f"refined by {len(points)} measured peak(s) at batch size(s) {batches}, {how}: {calib.formula()} "
            f"(runs within {calib.spread / 2**20:.0f} MiB of it)")


# Posterior SDs of the slope the cautious largest batch adds: the uncalibrated model has no term for kernels'
# own buffers (oneDNN), which grow with the batch and which a calibration's alloc run measures, so its effective
# slope spreads wider than calibrated slopes (0.5-1.5) do; one SD leaves resnet18 (64 px) above its real largest
# batch under 1.5 GB. Evidence: bench/calibration_accuracy.py, bench/results/calibration.json
CAUTION = 2.0


def cautious(calib: CpuCalibration, transient: list[int], resident: list[int]) -> CpuCalibration:
    """`calib` (fitted on runs at these transient peaks and resident sets, bytes) tilted CAUTION
    posterior SDs of its slope steeper about the runs' mean transient, so it still passes through them
    there. The SD is the posterior of fit.fit_line's prior (fit.slope_precision), with the
    runs' noise taken as the larger of RUN_NOISE of their resident set and the fit's spread (its
    largest residual, where fit_line uses their RMS: the wider of the two): one point gives the prior's
    0.35, points spanning far past their noise almost nothing."""
    x = np.asarray(transient, float)
    noise = max(RUN_NOISE * float(np.median(resident)), calib.spread, 1.0)
    sxx = float(((x - x.mean()) ** 2).sum())
    sd = slope_precision(sxx, noise ** 2) ** -0.5
    tilt = CAUTION * sd
    return replace(calib, slope=calib.slope + tilt, intercept=calib.intercept - tilt * float(x.mean()))

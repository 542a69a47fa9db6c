"""Refine the predicted peak with measured peaks of the same workload, device and configuration.

Pure: the measured (batch size, peak bytes) pairs come in, a curve of total bytes over the batch
size comes out. Peak memory is close to affine in the batch size (parameters, gradients and
optimizer state are constant; activations and the memory that holds them grow linearly), so:

- points at two or more batch sizes: least squares total(b) = intercept + slope x b, which
  replaces the estimator's curve (its own slope included). A negative slope means the points are
  noise (e.g. resident sets varying between identical runs by more than the batch adds): refused,
  and the points only shift the estimator's curve by their mean residual, as below.
- points at one batch size: the estimator's curve shifted by measured - predicted there. A shift
  rather than a scale because the estimator's batch dependence comes from traced tensor sizes,
  which match real allocations within about 1%; what it misses is mostly outside the tensors
  (the process's resident baseline, allocator retention), which barely depends on the batch. A
  scale would also multiply the exactly known parameter and optimizer-state bytes and stretch
  the curve's slope by the same factor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


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
            return f"{n}: total = {self.intercept / 2**20:.0f} MiB + {self.slope / 2**20:.2f} MiB x batch (least squares)"
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

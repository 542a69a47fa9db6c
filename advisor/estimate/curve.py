"""Per-device memory against batch size: one estimate, then its batch model's totals at other batch sizes
(no more traces), for the web page's plot and POST /v1/estimate/curve."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from advisor.errors import SpecError
from advisor.estimate.model import Breakdown, EstimateOptions, EstimateRequest, MemoryEstimate

if TYPE_CHECKING:
    from advisor.hardware.spec import HardwareSpec
    from advisor.workload import Workload

MAX_POINTS = 64  # batch sizes in one curve: each is a replay of the batch model, milliseconds to a second


class CurvePoint(BaseModel):
    """The request's configuration at one batch size."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch_size: int = Field(description="Micro-batch per device (samples).")
    total_bytes: int = Field(description="Predicted peak per device, as MemoryEstimate.total_bytes (bytes).")
    runtime_bytes: int = Field(description="Outside the allocator, as MemoryEstimate.runtime_bytes (bytes).")
    breakdown: Breakdown
    fits: bool = Field(description="total_bytes + runtime_bytes <= the estimate's usable_bytes.")


class MemoryCurve(BaseModel):
    """An estimate and its memory at several batch sizes. At the estimate's own batch a point repeats its
    figures; elsewhere they come from the batch model's line, without the real runs and exact traces that
    the largest-batch search may add, so `estimate.max_batch_size` can sit a little below the last point
    that fits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    estimate: MemoryEstimate
    points: list[CurvePoint] = Field(description="By batch size, ascending.")


def memory_curve(workload: Workload | str, hardware: HardwareSpec | str, request: EstimateRequest | None = None,
                 options: EstimateOptions | None = None, batch_sizes: list[int] | None = None, *,
                 workload_args: dict[str, Any] | None = None) -> MemoryCurve:
    """The estimate of `request` (estimate_memory's arguments) and the per-device memory at each of
    `batch_sizes` (at most MAX_POINTS; None: `default_batch_sizes` of the estimate). Raises what
    estimate_memory raises, and SpecError for a batch size below 1 or too many of them."""
    from advisor.estimate.estimator import estimate_fitted

    if batch_sizes is not None:
        _check(batch_sizes)
    est, ev = estimate_fitted(workload, hardware, request, options, workload_args=workload_args)
    own = est.request.batch_size
    points = []
    for b in sorted(set(batch_sizes if batch_sizes is not None else default_batch_sizes(est))):
        if b == own:
            total, runtime, breakdown = est.total_bytes, est.runtime_bytes, est.breakdown
        else:
            _, _, parts, _ = ev.at(b)
            total, runtime = ev.total(b)
            breakdown = _parts(parts, total)
        points.append(CurvePoint(batch_size=b, total_bytes=total, runtime_bytes=runtime, breakdown=breakdown,
                                 fits=total + runtime <= est.usable_bytes))
    return MemoryCurve(estimate=est, points=points)


def default_batch_sizes(est: MemoryEstimate) -> list[int]:
    """Powers of two from 1 through the largest batch that fits, that batch and one past it, and the
    request's own; where nothing fits, powers of two through the request's batch."""
    top = max(est.max_batch_size, 1)
    out = {1 << k for k in range(top.bit_length())} | {est.max_batch_size + 1, est.request.batch_size}
    if est.max_batch_size:
        out.add(est.max_batch_size)
    else:
        out |= {1 << k for k in range(est.request.batch_size.bit_length())}
    return sorted(out)[:MAX_POINTS]


def _check(batch_sizes: list[int]) -> None:
    if not 1 <= len(batch_sizes) <= MAX_POINTS:
        raise SpecError(f"give 1 to {MAX_POINTS} batch sizes, not {len(batch_sizes)}")
    bad = [b for b in batch_sizes if b < 1]
    if bad:
        raise SpecError(f"batch size {bad[0]} is not a positive integer")


def _parts(parts: dict[str, int], total: int) -> Breakdown:
    """As the estimate's breakdown: what tensors do not account for of `total` is overhead (never below 0)."""
    overhead = total - sum(parts.values())
    if overhead < 0:
        return Breakdown(**{**parts, "temporaries": parts["temporaries"] + overhead, "overhead": 0})
    return Breakdown(**parts, overhead=overhead)

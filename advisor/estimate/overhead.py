"""What the allocator and the runtime add on top of live tensors, per device type.

CUDA: the caching allocator's rounding and cached segments (cuda_alloc), and the context
outside it. CPU: glibc's heap holes and mmap threshold (heap), and what the process maps while
running the step (kernel code pages, OpenMP and oneDNN buffers): a calibrated figure when a short
real run on this CPU was allowed, else the default below.
"""

from __future__ import annotations

from dataclasses import dataclass

from advisor.estimate.cuda_alloc import RUNTIME_BYTES, simulate_cuda
from advisor.estimate.heap import simulate
from advisor.estimate.trace import Trace

MB = 1024 * 1024
# Resident bytes a CPU training step adds beyond glibc's view of tensors, when not calibrated:
# measured here for MLP, conv and transformer presets at small batch (bench/estimate_accuracy.py).
CPU_RUNTIME_DEFAULT = 100 * MB


@dataclass(frozen=True)
class CpuCalibration:
    """Resident bytes beyond the heap model, affine in batch size, fitted on this CPU."""

    intercept: float  # bytes
    per_sample: float  # bytes per sample
    alloc_intercept: float = 0.0  # live bytes kernels allocate that tracing does not see (bytes)
    alloc_per_sample: float = 0.0

    def runtime(self, batch: int) -> int:
        return int(self.intercept + self.per_sample * batch)

    def hidden_alloc(self, batch: int) -> int:
        return max(0, int(self.alloc_intercept + self.alloc_per_sample * batch))


@dataclass(frozen=True)
class Overhead:
    total: int  # predicted measured quantity (bytes)
    allocated: int  # predicted live-tensor peak (bytes)
    runtime: int  # bytes outside the allocator's count (CUDA context) (bytes)


def cpu_overhead(trace: Trace, allocated: int, batch: int, calib: CpuCalibration | None) -> Overhead:
    hidden = calib.hidden_alloc(batch) if calib else 0
    heap_extra = 0 if trace.synthetic else max(0, simulate(trace.sizes, trace.ids) - trace.peak_bytes)
    runtime = calib.runtime(batch) if calib else CPU_RUNTIME_DEFAULT
    return Overhead(total=allocated + hidden + heap_extra + runtime, allocated=allocated + hidden, runtime=0)


# Reserved over allocated for a synthetic (formula) trace: segment rounding of large blocks.
SYNTHETIC_RESERVED_RATIO = 1.05


def cuda_overhead(trace: Trace, allocated: int) -> Overhead:
    if trace.synthetic:
        return Overhead(total=int(allocated * SYNTHETIC_RESERVED_RATIO), allocated=allocated, runtime=RUNTIME_BYTES)
    peak_alloc, peak_res = simulate_cuda(trace.sizes, trace.ids)
    # Rounding and caching grow the single-device figures; apply the same ratio to the strategy's.
    scale = allocated / trace.peak_bytes if trace.peak_bytes else 1.0
    return Overhead(total=int(peak_res * scale), allocated=int(peak_alloc * scale), runtime=RUNTIME_BYTES)

"""What the allocator and the runtime add on top of live tensors, per device type.

CUDA: the caching allocator's rounding and cached segments (cuda_alloc), and the context
outside it. CPU: glibc keeps freed heap memory resident and the step maps kernel code, OpenMP
stacks and oneDNN buffers. Measured here, that extra grows with the live peak (0.3-0.8x of it,
by model) rather than being a constant, and a replay of the traced allocations through a model
of glibc's heap explained under a tenth of it (the rest is allocations tensors never see), so
the CPU resident set is fitted as `persistent + slope x transient + intercept` from short real runs at small
batch sizes on this CPU (calibrate.py), with the defaults below when no run is allowed; `transient` is the
heap-served transient bytes over the persistent peak where they live beside the persistent bytes, and
a share of the rest (strategy.resident_terms), as the heap serves gradients mostly from activations'
freed chunks. Transient
allocations that glibc maps on their own (32 MiB and up) are resident only while live, so they count
once, apart from the heap-served ones, at their own moments of the step (strategy.resident_parts).
"""

from __future__ import annotations

from dataclasses import dataclass

from advisor.estimate.cuda_alloc import RUNTIME_BYTES, simulate_cuda, with_workspaces
from advisor.estimate.trace import Trace

MB = 1024 * 1024


@dataclass(frozen=True)
class CpuCalibration:
    """Peak resident set = persistent peak + slope x transient + intercept (bytes).

    Persistent: parameters, gradients, optimizer state (big, long-lived: resident once each).
    Transient: heap-served activations and temporaries over the persistent peak where they live
    beside the persistent bytes, and a share of the rest (strategy.resident_terms); their freed memory stays partly resident
    in glibc's heap while the later phases allocate elsewhere; `slope` says how much, fitted on this
    CPU.
    """

    intercept: float  # bytes
    slope: float  # resident bytes per transient live byte
    hidden_ratio: float = 0.0  # live bytes kernels allocate inside themselves, per transient byte
    # How far one real run strayed from the fit (bytes): the largest batch keeps this much clear
    # of the cap, so a run that strays as far still fits.
    spread: float = 0.0
    # Resident bytes per sample of the batch beyond the transient term: what the heap keeps of the bytes a
    # step allocates and frees, where runs show it growing far faster than the transient peak (calibrate._fit).
    per_sample: float = 0.0

    def formula(self) -> str:
        per_sample = f" + {self.per_sample / MB:.1f} MiB x batch" if self.per_sample >= 0.05 * MB else ""
        return f"resident = persistent + {self.slope:.2f} x transient{per_sample} + {self.intercept / MB:.0f} MiB"

    def margin(self, resident: float) -> float:
        """What the largest batch keeps clear of the cap at a batch whose resident set is predicted
        `resident` (bytes): here, without runs, the spread."""
        return self.spread

    def resident(self, persistent: int, transient: int, mapped: int = 0, batch: int = 0) -> int:
        """`transient`: heap-served transient bytes over the persistent peak, and a share of the rest
        (strategy.resident_terms); `batch`: the samples per device (`per_sample`);
        `mapped`: what transient allocations glibc maps on their own add to the persistent peak where
        they live (strategy.resident_parts): resident only
        while they live, they add nothing at moments they are not."""
        return int(persistent + self.slope * transient + self.per_sample * batch + mapped + self.intercept)

    def at_batch(self, b: int, line: float) -> float:
        """The resident set at batch b given the fit's `line` there (bytes): here, without runs, the line."""
        return line

    def hidden(self, transient: int) -> int:
        """Kernel-internal buffers (oneDNN scratchpads, RNN workspaces) at this transient peak (bytes)."""
        return int(self.hidden_ratio * transient)


# Uncalibrated default: the medians of lines fitted on this project's 2-vCPU benchmark VM (an AMD
# EPYC, 2026-11-26) over presets outside the accuracy grid, by plain least squares through each one's
# calibration runs and three runs at its batch under glibc's default allocator (bench/resident_probe.py
# `collect --presets`, then `default`): tiny-gpt2, tiny-resnet, resnet18 at 64 px, mlp with hidden
# 1024, tiny-lstm, tiny-unet, tiny-bert, tiny-vit, tiny-dlrm and tiny-llama in fp32 with adamw, the
# first three in bf16 with sgd-momentum too, at batches where the resident set is 0.16-0.5 GB:
# intercepts 103-150 MiB, slopes 1.23-2.68. On the accuracy grid's 32 cases from batch 16 up
# (session 23's records of them, outside the fitting set) the uncalibrated resident set comes out
# 4.3% off at the median and 13.7% at most, against 9.7% and 23.6% (all low) with the 100 MiB +
# 1.15x it replaces, the medians of calibrations, whose runs lie within a few times of each other,
# where the resident set grows less per transient byte than it does from there to the batch. It says
# nothing certain about another machine's allocator or libraries: calibrate where the target is this
# CPU. A calibration's own fit draws its slope toward calibrate.SLOPE_PRIOR_MEAN, not this. With
# strategy.UNREUSED_SHARE in the transient term (session 32) the same records' medians are 108 MiB + 1.54x,
# and this default comes out 4.4% / 12.6% on the grid's 32 (7.3% / 21.5% on the fitting set, against
# 8.4% / 20.8% before): it stays.
CPU_DEFAULT = CpuCalibration(intercept=121 * MB, slope=1.53)


@dataclass(frozen=True)
class Overhead:
    total: int  # predicted measured quantity (bytes)
    allocated: int  # predicted live-tensor peak (bytes)
    runtime: int  # bytes outside the allocator's count (CUDA context) (bytes)


def cpu_overhead(allocated: int, persistent: int, transient: int, calib: CpuCalibration | None,
                 mapped: int = 0, floor: int | None = None, batch: int = 0, runs: bool = False) -> Overhead:
    """`floor`: the least the resident set can be, the live bytes kernels wrote at their peak
    (strategy.touched_peak); default `allocated`. `batch`: the samples per device. `runs`: the
    calibration's real runs at that batch itself weigh in (CpuCalibration.at_batch)."""
    calib = calib or CPU_DEFAULT
    resident = calib.resident(persistent, transient, mapped, batch)
    if runs:
        resident = int(calib.at_batch(batch, resident))
    total = max(allocated if floor is None else floor, resident)
    return Overhead(total=total, allocated=allocated, runtime=0)


# Reserved over allocated for a synthetic (formula) trace: segment rounding of large blocks.
SYNTHETIC_RESERVED_RATIO = 1.05


def cuda_overhead(trace: Trace, allocated: int, workspaces: list[tuple[int | None, int]] = ()) -> Overhead:
    """`allocated`: the traced live peak for the strategy; `workspaces`: library workspaces that the trace
    does not allocate and that stay allocated (cuBLAS's: `cuda_alloc.library_workspaces`), as (event index,
    bytes): taken from the pool before that event, or, without an index, each in a segment of its own."""
    workspace = sum(n for _, n in workspaces)
    if trace.synthetic:
        return Overhead(total=int(allocated * SYNTHETIC_RESERVED_RATIO) + workspace, allocated=allocated + workspace,
                        runtime=RUNTIME_BYTES)
    placed = sum(n for i, n in workspaces if i is not None)
    peak_alloc, peak_res = simulate_cuda(*with_workspaces(trace.sizes, trace.ids, list(workspaces)))
    # Rounding and caching grow the single-device figures; apply the same ratio to the strategy's (the
    # workspaces are the same on every device).
    scale = allocated / trace.peak_bytes if trace.peak_bytes else 1.0
    return Overhead(total=int((peak_res - placed) * scale) + workspace,
                    allocated=int((peak_alloc - placed) * scale) + workspace, runtime=RUNTIME_BYTES)

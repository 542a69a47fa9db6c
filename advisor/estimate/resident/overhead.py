"""The CPU resident-set line, resident = persistent + slope x transient + intercept, and its default without runs."""

from __future__ import annotations

from dataclasses import dataclass

from advisor.estimate.overhead import Overhead

MB = 1024 * 1024


@dataclass(frozen=True)
class CpuCalibration:
    """Peak resident set = persistent peak + slope x transient + intercept (bytes).

    glibc keeps freed heap memory resident and the step maps kernel code, OpenMP stacks and oneDNN
    buffers: an extra that grows with the live peak (0.3-0.8x of it, by model), so it is fitted on
    short real runs on this CPU (calibrate.py). Persistent: parameters, gradients, optimizer state
    (resident once each). Transient: heap-served activations and temporaries over the persistent peak
    where they live beside it, and a share of the rest (terms.resident_terms); their freed memory stays
    partly resident in glibc's heap while later phases allocate elsewhere, `slope` says how much.
    Allocations glibc maps on their own (32 MiB and up) count once, at their own moments (`resident`).
    """

    intercept: float  # bytes
    slope: float  # resident bytes per transient live byte
    hidden_ratio: float = 0.0  # live bytes kernels allocate inside themselves, per transient byte
    # How far one real run strayed from the fit (bytes): the largest batch keeps this much clear
    # of the cap, so a run that strays as far still fits.
    spread: float = 0.0
    # Resident bytes per sample of the batch beyond the transient term: what the heap keeps of the bytes a
    # step allocates and frees, where runs show it growing far faster than the transient peak (fit.fit_line).
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
        (terms.resident_terms); `batch`: the samples per device (`per_sample`); `mapped`: what transient
        allocations glibc maps on their own add to the persistent peak where they live
        (terms.resident_parts): resident only while they live, they add nothing at moments they are not."""
        return int(persistent + self.slope * transient + self.per_sample * batch + mapped + self.intercept)

    def at_batch(self, b: int, line: float) -> float:
        """The resident set at batch b given the fit's `line` there (bytes): here, without runs, the line."""
        return line

    def hidden(self, transient: int) -> int:
        """Kernel-internal buffers (oneDNN scratchpads, RNN workspaces) at this transient peak (bytes)."""
        return int(self.hidden_ratio * transient)


# Without runs: the medians of least-squares lines through ten presets' calibration runs and runs at their
# batch (resident sets 0.16-0.5 GB; intercepts 103-150 MiB, slopes 1.23-2.68). Another machine's allocator
# may differ: calibrate where the target is this CPU. A calibration draws its slope toward fit.SLOPE_PRIOR_MEAN.
# Evidence: bench/research/resident_probe.py (default), bench/results/archive/resident_probe-presets.jsonl
CPU_DEFAULT = CpuCalibration(intercept=121 * MB, slope=1.53)


def cpu_overhead(allocated: int, persistent: int, transient: int, calib: CpuCalibration | None,
                 mapped: int = 0, floor: int | None = None, batch: int = 0, runs: bool = False) -> Overhead:
    """`floor`: the least the resident set can be, the live bytes kernels wrote at their peak
    (terms.touched_peak); default `allocated`. `batch`: the samples per device. `runs`: the
    calibration's real runs at that batch itself weigh in (CpuCalibration.at_batch)."""
    calib = calib or CPU_DEFAULT
    resident = calib.resident(persistent, transient, mapped, batch)
    if runs:
        resident = int(calib.at_batch(batch, resident))
    total = max(allocated if floor is None else floor, resident)
    return Overhead(total=total, allocated=allocated, runtime=0)

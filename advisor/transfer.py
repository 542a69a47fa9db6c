"""Carry a configuration measured on one target over to another: the device, a precision the target
supports, knobs that cannot apply there dropped (as `advisor.trial.inapplicable` decides), and the
batch rescaled to the target's memory. Pure functions; the estimates come from the caller."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from advisor.config import Precision, Strategy
from advisor.errors import SpecError
from advisor.trial import CompileMode, Pinning, TrainingConfig, inapplicable

if TYPE_CHECKING:
    from advisor.hardware.spec import HardwareSpec
    from advisor.workload import Workload

# On a tie in peak TFLOP/s, the earlier precision wins: no loss of range or a grad scaler for nothing.
_PREFERENCE = (Precision.fp32, Precision.tf32, Precision.bf16, Precision.fp16)
# Without the source's precision on the target: what stands for it (same memory per value first).
_SUBSTITUTES = {Precision.bf16: (Precision.fp16, Precision.fp32), Precision.bf16_pure: (Precision.fp16, Precision.fp32),
                Precision.fp16: (Precision.bf16, Precision.fp32), Precision.tf32: (Precision.fp32,),
                Precision.fp32: ()}
# A compile mode with CUDA graphs on a CPU becomes the same mode without them.
_NO_CUDAGRAPHS = {CompileMode.reduce_overhead: CompileMode.default,
                  CompileMode.max_autotune: CompileMode.max_autotune_no_cudagraphs}


def _with(config: TrainingConfig, **knobs: Any) -> TrainingConfig:
    """A validated copy (model_copy would skip the structural checks)."""
    return TrainingConfig(**{**config.model_dump(), **knobs})


def supports(hw: "HardwareSpec", precision: Precision) -> bool:
    """Whether `precision` can run on `hw` (the same rules as `inapplicable`)."""
    return inapplicable(TrainingConfig(device=hw.device_type, precision=precision), hw) is None


def best_precision(hw: "HardwareSpec") -> Precision:
    """The supported precision with the highest peak TFLOP/s on `hw`; ties go to fp32, tf32, bf16, fp16 in turn."""
    peaks = hw.accelerator.peak_tflops
    usable = [p for p in _PREFERENCE if supports(hw, p)]
    return max(usable, key=lambda p: (peaks.get(p.value, peaks.get("fp32", 0.0)), -_PREFERENCE.index(p)))


def _precision_for(config: TrainingConfig, hw: "HardwareSpec") -> Precision | None:
    """The substitute for the config's precision on `hw`, or None when it runs there as is."""
    if supports(hw, config.precision):
        return None
    for p in _SUBSTITUTES[config.precision]:
        if supports(hw, p):
            return p
    return Precision.fp32


def _fix_once(c: TrainingConfig, hw: "HardwareSpec", wl: "Workload | None") -> tuple[TrainingConfig, str] | None:
    """The first change that removes a reason `inapplicable` gives, with what changed; None when none does."""
    if c.device != hw.device_type:
        return _with(c, device=hw.device_type), f"device {c.device} -> {hw.device_type}"
    precision = _precision_for(c, hw)
    if precision is not None:
        return _with(c, precision=precision), f"precision {c.precision.value} -> {precision.value}"
    if c.device == "cpu" and c.compile_mode.uses_cudagraphs:
        mode = _NO_CUDAGRAPHS[c.compile_mode]
        return _with(c, compile_mode=mode), f"compile mode {c.compile_mode.value} -> {mode.value}"
    if c.device == "cpu" and c.pin_memory:
        return _with(c, pin_memory=False), "pin_memory dropped"
    if c.device == "cuda" and c.nproc > hw.devices_per_node:
        n = hw.devices_per_node
        knobs = {"nproc": n, "strategy": c.strategy if n > 1 else Strategy.single}
        return _with(c, **knobs), f"processes {c.nproc} -> {n}"
    if c.channels_last and wl is not None and not wl.conv_net:
        return _with(c, channels_last=False), "channels_last dropped"
    return None


def adapt(config: TrainingConfig, source: "HardwareSpec", target: "HardwareSpec",
          workload: "Workload | None" = None) -> tuple[TrainingConfig, list[str]]:
    """`config` made runnable on `target`: each change says what changed and why it had to.

    An explicit CPU list names CPUs of the host it was measured on, so on other hardware it
    becomes pinning to the device's local node. SpecError when a knob still cannot apply.
    """
    notes: list[str] = []
    c = config
    if c.pinning == Pinning.cpus and source != target:
        c = _with(c, pinning=Pinning.node, cpu_list=None)
        notes.append(f"pinning cpus {config.cpu_list} -> node: a CPU list belongs to the host it was measured on")
    for _ in range(8):  # each step removes one reason; there are fewer than eight kinds
        why = inapplicable(c, target, workload)
        if why is None:
            return c, notes
        fixed = _fix_once(c, target, workload)
        if fixed is None:
            break
        c, what = fixed
        notes.append(f"{what}: {why}")
    raise SpecError(f"configuration cannot run on {target.accelerator.name}: {inapplicable(c, target, workload)}")


AT_LIMIT = 0.9  # a source batch at or above this share of its largest fitting batch was limited by memory


def rescale_batch(batch: int, source_max: int, target_max: int, *, cap: int | None = None) -> int:
    """The micro-batch on the target (samples), at most `cap` (e.g. the dataset per process); 0 when nothing fits.

    A best found at the source's memory limit (AT_LIMIT of its largest batch or more) was held
    there by memory, so the target's largest batch replaces it; a best below the limit was
    chosen for speed and is kept where it fits, else the target's largest batch takes its place.
    """
    if target_max <= 0:
        return 0
    at_limit = source_max > 0 and batch >= AT_LIMIT * source_max
    out = target_max if at_limit else min(batch, target_max)
    return max(1, min(out, cap)) if cap is not None else out


def with_batch(config: TrainingConfig, batch: int) -> TrainingConfig:
    """`config` at micro-batch `batch`; with gradient accumulation, the samples per optimizer step
    are kept where a divisor of them at most `batch` exists (grad_accum adjusted)."""
    if config.grad_accum == 1 or config.fused_backward:
        return _with(config, batch_size=batch)
    per_step = config.batch_size * config.grad_accum
    micro = max(d for d in range(1, min(batch, per_step) + 1) if per_step % d == 0)
    return _with(config, batch_size=micro, grad_accum=per_step // micro)

"""Roofline time of a training step: FLOPs over the device's peak, or bytes over its bandwidth.

Williams, Waterman, Patterson 2009 ("Roofline: an insightful visual performance model"). The
FLOPs come from the traced step (torch.utils.flop_counter); the bytes are a floor: every live
parameter, gradient and optimizer-state byte is read or written at least once per step, and
activations are written in forward and read in backward.
"""

from __future__ import annotations

from advisor.config import Precision
from advisor.hardware.spec import HardwareSpec

# Fraction of the datasheet peak a well-tuned training step reaches on big matmuls; used so
# predicted times are comparable with measured ones (MFU of 40-55% is typical on A100/H100).
ACHIEVABLE_FRACTION = 0.5


def peak_flops(hw: HardwareSpec, precision: Precision) -> float:
    """Peak FLOP/s of one device for the precision's matmul dtype."""
    key = {Precision.fp32: "fp32", Precision.tf32: "tf32", Precision.bf16: "bf16", Precision.bf16_pure: "bf16",
           Precision.fp16: "fp16"}[precision]
    peaks = hw.accelerator.peak_tflops
    if key == "fp16" and not peaks.get(key) and not hw.accelerator.supports_fp16:
        # fp32's peak is no stand-in: on a CPU without AVX512-FP16 (a Zen 4) an fp16 (2048, 768) x (768, 3072)
        # product runs at 0.9 GFLOP/s (10.4 s), about 1/180 of its fp32 peak (bf16's takes 0.03 s)
        raise ValueError(f"{hw.accelerator.name} has no fp16 peak: fp16 is not a training path it supports, and its "
                         "fp32 peak says nothing of its fp16 products (a Zen 4's ran at 1/180 of it)")
    tflops = peaks.get(key) or peaks.get("fp32")
    if not tflops:
        raise ValueError(f"{hw.accelerator.name} has no peak TFLOP/s for {key} or fp32")
    return tflops * 1e12


def step_time(hw: HardwareSpec, precision: Precision, flops: int, bytes_moved: int) -> float:
    """Predicted seconds per micro-batch step: the slower of compute and memory traffic."""
    compute = flops / (peak_flops(hw, precision) * ACHIEVABLE_FRACTION)
    memory = bytes_moved / (hw.accelerator.memory_bandwidth_gbps * 1e9)
    return max(compute, memory)

"""Turn the ranks' reports into one TrialResult: throughput, percentiles, memory, MFU, verdict."""

from __future__ import annotations

from statistics import median
from typing import Any

from advisor.hardware.spec import HardwareSpec
from advisor.trial import CompileMode, StepTimes, TrainingConfig, TrialResult, TrialStatus
from advisor.workload import WorkloadInfo
from probes.child import ChildReport
from probes.verdict import bottleneck


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _peak_tflops(hw: HardwareSpec, config: TrainingConfig) -> float | None:
    key = {"bf16-pure": "bf16"}.get(config.precision.value, config.precision.value)
    return hw.accelerator.peak_tflops.get(key) or hw.accelerator.peak_tflops.get("fp32")


def summarize(reports: list[ChildReport | None], wl: WorkloadInfo, hw: HardwareSpec, config: TrainingConfig,
              estimate: Any, wall_s: float, base: dict[str, Any], notes: list[str]) -> TrialResult:
    """Rank 0's timings (every rank steps in lockstep) with each rank's parameter digest."""
    r0 = reports[0]
    assert r0 is not None  # the caller checked every rank reported ok
    steps, waits = r0.step_times, r0.data_times
    measured = sum(steps)
    samples_s = r0.samples_per_step * len(steps) / measured
    wait_frac = sum(waits) / measured
    p50 = median(steps)
    flops = None
    if estimate is not None:  # per micro-batch of one rank -> per optimizer step of one rank
        flops = estimate.flops_per_step * config.grad_accum
    peak_tf = _peak_tflops(hw, config)
    mfu = flops / p50 / (peak_tf * 1e12) if flops and peak_tf else None
    verdict = bottleneck(data_wait_fraction=wait_frac, compute_s=p50 - median(waits), ops_per_step=r0.ops_per_step,
                         op_overhead_s=r0.op_overhead_s, flops_per_step=flops, step_s=p50,
                         compiled=config.compile_mode != CompileMode.none, device=config.device)
    warmup = sum(r0.warmup_times)
    compile_s = max(0.0, warmup - len(r0.warmup_times) * p50) if config.compile_mode != CompileMode.none else None
    peak = r0.peak
    quantity = peak.cuda_reserved_bytes if config.device == "cuda" else peak.cpu_rss_bytes
    return TrialResult(
        status=TrialStatus.ok, samples_per_s=samples_s,
        tokens_per_s=samples_s * wl.tokens_per_sample if wl.tokens_per_sample else None,
        step_time_s=StepTimes(p50=p50, p90=percentile(steps, 90), mean=measured / len(steps)),
        data_wait_fraction=wait_frac, peak_memory_bytes=quantity, peak_memory=peak,
        predicted_memory_bytes=estimate.total_bytes if estimate is not None else None,
        predicts=estimate.predicts if estimate is not None else None, compile_s=compile_s, warmup_s=warmup,
        compiled_graphs=r0.compiled_graphs,
        measured_s=measured, measured_steps=len(steps), mfu=mfu, bottleneck=verdict, environment=r0.environment,
        wall_s=wall_s, overhead_s=max(0.0, wall_s - warmup - measured),
        build_s=r0.marks["built"] - r0.marks["setup"] if {"built", "setup"} <= r0.marks.keys() else None,
        notes=[*notes, *r0.notes],
        rank_digests=[r.digest for r in reports if r is not None and r.digest], **base)

"""The conditions every configuration a space yields must meet, written out independently of the
YAML so a preset that lost a condition (or code that stopped evaluating one) fails the tests."""

from __future__ import annotations

from advisor.parallel.layout import layout_problems
from advisor.trial import CompileMode, TrainingConfig, inapplicable
from search_spaces import SpaceContext


def violations(c: TrainingConfig, ctx: SpaceContext) -> list[str]:
    out = []
    problem = inapplicable(c, ctx.hardware)
    if problem:
        out.append(problem)
    if c.num_workers == 0 and (c.prefetch_factor is not None or c.persistent_workers):
        out.append("prefetch/persistent without workers")
    if c.strategy.value != "single" and (ctx.device_count < 2 or c.nproc != ctx.device_count):
        out.append(f"{c.strategy.value} with nproc {c.nproc} on {ctx.device_count} devices")
    parallel = c.tp * c.pp * c.cp > 1
    if c.strategy.value == "single" and c.nproc != 1 and not parallel:
        out.append("single with several processes")
    if parallel and ctx.decoder is None:
        out.append(f"tp {c.tp} x pp {c.pp} x cp {c.cp} for a workload that is not a decoder")
    if parallel and c.nproc != ctx.device_count:
        out.append(f"tp {c.tp} x pp {c.pp} x cp {c.cp} on {c.nproc} of {ctx.device_count} devices")
    if parallel and ctx.decoder is not None:
        out += layout_problems(c.layout(), world=ctx.device_count, decoder=ctx.decoder, batch_size=c.batch_size)
    if c.pp == 1 and (c.pp_schedule.value != "1f1b" or c.microbatches is not None or c.virtual_stages != 1
                      or c.micro_batch_size is not None):
        out.append("pipeline knobs without pp")
    if ctx.device == "cpu" and (c.precision.value in ("fp16", "tf32") or c.pin_memory
                                or c.compile_mode in (CompileMode.reduce_overhead, CompileMode.max_autotune)):
        out.append("a CUDA-only knob on the CPU")
    if c.precision.value in ("bf16", "bf16-pure") and not ctx.hardware.accelerator.supports_bf16:
        out.append("bf16 without hardware support")
    if c.channels_last and not ctx.conv_net:
        out.append("channels_last on a net without convolutions")
    if c.fused_backward and (c.strategy.value != "single" or c.grad_accum != 1):
        out.append("fused_backward with accumulation or data parallelism")
    g, dp = ctx.global_batch_size, c.nproc // (c.tp * c.pp * c.cp)  # a replica's tp, pp and cp ranks share its samples
    if g is not None and c.batch_size * c.grad_accum * dp != g:
        out.append(f"{c.batch_size} x {c.grad_accum} x {dp} replicas != global batch {g}")
    return out

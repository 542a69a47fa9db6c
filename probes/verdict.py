"""The bottleneck verdict of a trial, from the numbers it measured."""

from __future__ import annotations

from advisor.trial import Bottleneck

INPUT_BOUND_WAIT = 0.25  # share of step time waiting for data above which the input pipeline is the limit
OVERHEAD_BOUND_DISPATCH = 0.5  # share of compute time that op dispatch alone explains


def bottleneck(*, data_wait_fraction: float, compute_s: float, ops_per_step: int | None, op_overhead_s: float | None,
               flops_per_step: float | None, step_s: float, compiled: bool, device: str) -> Bottleneck:
    """input-bound, overhead-bound or compute-bound, with the figures behind the call.

    Overhead is judged from what this process pays to dispatch one tiny op (measured) times the
    ops one step dispatches (counted in an eager step): if that alone is most of the compute time,
    the step is a stream of small kernels, which compile (fusion) or CUDA graphs (launch) remove.
    """
    dispatch = None
    if ops_per_step is not None and op_overhead_s is not None and compute_s > 0:
        dispatch = ops_per_step * op_overhead_s / compute_s
    achieved = flops_per_step / step_s / 1e12 if flops_per_step and step_s > 0 else None
    common = dict(data_wait_fraction=data_wait_fraction, ops_per_step=ops_per_step, op_overhead_s=op_overhead_s,
                  dispatch_fraction=dispatch, achieved_tflops=achieved)
    if data_wait_fraction >= INPUT_BOUND_WAIT:
        reason = (f"the step waits for data {data_wait_fraction:.0%} of the time: more DataLoader workers, "
                  "prefetch or persistent workers" + (", pinned memory" if device == "cuda" else "") + " would help")
        return Bottleneck(verdict="input-bound", reason=reason, **common)
    if dispatch is not None and dispatch >= OVERHEAD_BOUND_DISPATCH:
        fix = "torch.compile (fewer, fused kernels)" + (" or CUDA graphs (reduce-overhead)" if device == "cuda" else "")
        reason = (f"{ops_per_step} ops per step x {op_overhead_s * 1e6:.1f} us dispatch each = {dispatch:.0%} of "
                  f"compute time: {fix}, or a larger batch, would help")
        return Bottleneck(verdict="overhead-bound", reason=reason, **common)
    parts = [f"data wait {data_wait_fraction:.0%}"]
    if dispatch is not None:
        parts.append(f"dispatch {dispatch:.0%} of compute")
    if achieved is not None:
        parts.append(f"{achieved:.3g} TFLOP/s achieved")
    if compiled:
        parts.append("already compiled")
    return Bottleneck(verdict="compute-bound", reason="; ".join(parts) + ": the math itself is the limit", **common)

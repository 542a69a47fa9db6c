"""ZeRO-Offload on the ranks of a parallel layout (Ren et al. 2021; FSDP2's CPUOffloadPolicy under zero3): what
leaves a rank's device, taken out of its traced run, and what the rank keeps in host memory instead.

The host steps the optimizer, so its state and the step's temporaries leave the device. Offloading parameters
(zero3 only) keeps each parameter's shard on the host, and each gradient once reduce-scattered; the device keeps
the units FSDP gathers while they are in use and the gradients until they are reduced.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from advisor.config import Strategy
from advisor.estimate.trace import OPT_STATE, PARAMS, STEP_TEMPS, Trace

if TYPE_CHECKING:
    from advisor.estimate.model import EstimateRequest
    from advisor.parallel.layout import Layout


def offload_problem(layout: Layout, request: EstimateRequest) -> str | None:
    """Why `request`'s offload cannot apply to `layout` (one line), or None."""
    if request.offload_params and layout.strategy != Strategy.zero3:
        return (f"offload_params needs strategy zero3 (the parameters must be sharded to live on the host); this "
                f"layout is {layout.label()}")
    return None


def offloads(request: EstimateRequest) -> bool:
    return request.offload_optimizer or request.offload_params


def host_bytes(trace: Trace, request: EstimateRequest) -> int:
    """Bytes one rank keeps in host memory under `request`'s offload: the optimizer state and, for the host's step
    to read and write, the rank's parameters and gradients (its shards under ZeRO), as `trace` (the rank's run,
    before offload) holds them at the step; 0 without offload."""
    return trace.param_bytes + trace.grad_bytes + trace.opt_state_bytes if offloads(request) else 0


def on_device(trace: Trace, request: EstimateRequest) -> Trace:
    """`trace` (a rank's traced run, its last step an optimizer step) less the allocations that offload keeps on
    the host, events and all, so that a replay of its allocations (overhead.cuda_overhead) sees them gone too.

    An event's category is the curve column it moves. The optimizer's state and temporaries are those categories'.
    Under offload_params, the parameters at rest are the build's parameter allocations still live at the end, and
    the gradients the allocations made before the last optimizer step and freed during it (zero_grad)."""
    if not offloads(request) or trace.synthetic:
        return trace
    moved = np.diff(trace.curve, axis=0, prepend=np.zeros((1, trace.curve.shape[1]), dtype=trace.curve.dtype))
    category = np.where((moved != 0).any(axis=1), np.abs(moved).argmax(axis=1), -1)
    drop = np.isin(category, (OPT_STATE, STEP_TEMPS))
    if request.offload_params:
        drop |= np.isin(trace.ids, _params_and_gradients(trace, category))
    keep = ~drop
    index = np.cumsum(keep) - 1  # an event's index among the kept ones
    return replace(trace, curve=np.cumsum(moved * keep[:, None], axis=0)[keep], sizes=trace.sizes[keep],
                   ids=trace.ids[keep], untouched=None if trace.untouched is None else trace.untouched[keep],
                   phases=None if trace.phases is None else trace.phases[keep],
                   cublas_at=tuple((int(index[i]), kind) for i, kind in trace.cublas_at if keep[i]))


def _params_and_gradients(trace: Trace, category: np.ndarray) -> np.ndarray:
    """Allocation ids of the parameters at rest (FSDP2's shards) and of the gradients at the last step."""
    if trace.phases is None:
        raise ValueError("offload_params needs a trace that records its phases")
    made = trace.sizes > 0
    freed_ids = trace.ids[trace.sizes < 0]
    at_rest = made & (trace.phases == 0) & (category == PARAMS) & ~np.isin(trace.ids, freed_ids)
    step = trace.phases.max() - 1  # a step's phases end with the optimizer step's, then "done"
    freed_in_step = trace.ids[(trace.sizes < 0) & (trace.phases == step)]
    grads = made & (trace.phases < step) & np.isin(trace.ids, freed_in_step)
    return np.unique(trace.ids[at_rest | grads])

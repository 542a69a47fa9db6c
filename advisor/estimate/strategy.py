"""How each parallel strategy scales the traced single-device curve, per category.

ZeRO stages after Rajbhandari et al. 2020 ("ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", sec. 5): stage 1 shards optimizer state, stage 2 also gradients, stage 3 also
parameters, each across the N data-parallel ranks. As PyTorch FSDP2 runs them, a sharded unit is
all-gathered before use (its own block plus one prefetched: 2 units) and its gradient exists in
full until reduce-scattered (1 unit). DDP keeps gradient buckets beside .grad (bytes = gradients)
unless gradient_as_bucket_view is set.
"""

from __future__ import annotations

import numpy as np

from advisor.config import Strategy
from advisor.estimate.model import EstimateRequest
from advisor.estimate.trace import (
    ACTIVATIONS,
    CATEGORY_NAMES,
    GRADS,
    INPUTS,
    OPT_STATE,
    PARAM_COPIES,
    PARAMS,
    STEP_TEMPS,
    TEMPORARIES,
    Trace,
)


def category_weights(req: EstimateRequest, world: int) -> np.ndarray:
    """Per-category multipliers of the traced live bytes on one device of `world`."""
    w = np.ones(len(CATEGORY_NAMES))
    n = max(world, 1)
    if req.strategy in (Strategy.zero1, Strategy.zero2, Strategy.zero3):
        w[OPT_STATE] = w[STEP_TEMPS] = 1.0 / n
    if req.strategy in (Strategy.zero2, Strategy.zero3):
        w[GRADS] = 1.0 / n
    if req.strategy == Strategy.zero3:
        w[PARAMS] = 0.0 if req.offload_params else 1.0 / n
        w[PARAM_COPIES] = 1.0 / n
    if req.offload_optimizer:
        w[OPT_STATE] = w[STEP_TEMPS] = 0.0
    return w


def constant_extras(req: EstimateRequest, trace: Trace, world: int) -> dict[int, int]:
    """Bytes a strategy adds for the whole step, by category (buckets, gathered units)."""
    unit = trace.largest_block_bytes or trace.param_bytes
    extras: dict[int, int] = {}
    if req.strategy in (Strategy.ddp, Strategy.zero1) and world > 1:  # zero1 is DDP under ZeroRedundancyOptimizer
        extras[GRADS] = trace.grad_bytes
    if req.strategy in (Strategy.zero2, Strategy.zero3) and world > 1:
        extras[GRADS] = min(unit, trace.grad_bytes)
    if req.strategy == Strategy.zero3 and world > 1:
        extras[PARAMS] = min(2 * unit, trace.param_bytes)
    return extras


def scaled_curve(req: EstimateRequest, trace: Trace, world: int) -> np.ndarray:
    """(events, categories) live bytes per category on one device under the requested strategy."""
    curve = trace.curve * category_weights(req, world)
    for cat, extra in constant_extras(req, trace, world).items():
        curve[:, cat] += extra
    return curve


def peak_breakdown(curve: np.ndarray) -> tuple[int, dict[str, int]]:
    """The peak of the summed curve and the categories at that moment (bytes)."""
    if len(curve) == 0:
        return 0, {"parameters": 0, "gradients": 0, "optimizer_state": 0, "activations": 0, "temporaries": 0}
    total = curve.sum(axis=1)
    i = int(np.argmax(total))
    row = curve[i]
    parts = {
        "parameters": int(row[PARAMS] + row[PARAM_COPIES]),
        "gradients": int(row[GRADS]),
        "optimizer_state": int(row[OPT_STATE]),
        "activations": int(row[ACTIVATIONS] + row[INPUTS]),
        "temporaries": int(row[TEMPORARIES] + row[STEP_TEMPS]),
    }
    return int(sum(parts.values())), parts


PERSISTENT = (PARAMS, GRADS, OPT_STATE)


def persistent_transient(curve: np.ndarray) -> tuple[int, int]:
    """Peaks over the step of the long-lived categories and of everything else (bytes)."""
    if len(curve) == 0:
        return 0, 0
    mask = np.zeros(curve.shape[1], dtype=bool)
    mask[list(PERSISTENT)] = True
    return int(curve[:, mask].sum(axis=1).max()), int(curve[:, ~mask].sum(axis=1).max())

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
from advisor.estimate.trace import (ACTIVATIONS, CATEGORY_NAMES, GRADS, INPUTS, OPT_STATE, PARAM_COPIES, PARAMS, STEP_TEMPS,
                                    TEMPORARIES, Trace)
from advisor.procmem import MMAP_THRESHOLD_MAX


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
    if req.strategy == Strategy.ddp and world > 1:
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


# glibc's malloc maps a request of its own once its chunk is over MMAP_THRESHOLD_MAX and unmaps it on
# free; smaller ones come from the heap once the dynamic threshold has risen past them (it rises to
# each freed mapped chunk up to that maximum), and a freed heap chunk stays resident. The chunk adds
# a header and rounds to the page: requests from here up are mapped.
MMAP_FROM_BYTES = MMAP_THRESHOLD_MAX - 4096


def mmap_from(threshold: int | None) -> int:
    """The request size from which a process whose glibc mmap threshold is fixed at `threshold` bytes
    (MALLOC_MMAP_THRESHOLD_) maps it (bytes); None: glibc's dynamic default (MMAP_FROM_BYTES)."""
    return MMAP_FROM_BYTES if threshold is None else max(0, threshold - 4096)


def resident_parts(curve: np.ndarray, synthetic: bool = False, untouched: np.ndarray | None = None,
                   mapped_from: int = MMAP_FROM_BYTES) -> tuple[int, int, int, int]:
    """(persistent peak, transient peak of heap-served allocations, transient peak of mapped ones,
    what the mapped ones add to the persistent peak) (bytes). Freed heap memory stays resident and
    mapped memory does not, so the two transient parts weigh differently in the resident set. A
    mapping is resident only while it lives, so it adds only to the long-lived bytes of its own
    moments: the last item is max over the step of persistent(t) + mapped(t), less the persistent
    peak. Gradients set to None before the forward are not there when the forward's large
    activations are. A frozen backbone under a trainable head (bench/workloads/unseen.py, fp32
    sgd-momentum b64): 90 MiB of mapped activations in the forward, while the head's 67 MiB of
    gradients live from the backward to the step; adding the two peaks put the estimate 14% over,
    the step's own moments 1.5% (bench/BENCHMARKS.calibration.md, session 18). A synthetic curve
    (peak moments, not events) counts everything as heap-served. `untouched`, `mapped_from`: as in
    `split_over_step`."""
    return resident_terms(curve, synthetic, untouched, mapped_from)[:4]


# The share of the heap-served transient peak that lies under the persistent peak (bytes a perfect heap
# would serve again from freed chunks to gradients and optimizer state) which glibc's heap does not serve
# again: freed chunks of tensors' sizes are split and pinned apart by small allocations, so part of what
# is freed stays resident beside what comes later. Fitted offline on 54 recorded calibrations of three
# sessions (`bench/resident_probe.py compare`, bench/BENCHMARKS.calibration.md, "Session 32"): a
# plateau from 0.2 to 0.3, where the fitted resident set at the batch is 10.2-10.4% off at most against
# 13.0% with none (0: full reuse) and 13.9% with all (1: no reuse), the median 2.6-2.9% either way.
UNREUSED_SHARE = 0.25


def heap_term(heap_peak: int, over: int, unreused_share: float = UNREUSED_SHARE) -> int:
    """The resident set's heap-served transient term (bytes): the bytes `over` the persistent peak, and
    `unreused_share` of the rest of the heap-served transient peak `heap_peak`."""
    return over + int(unreused_share * (heap_peak - over))


def resident_terms(curve: np.ndarray, synthetic: bool = False, untouched: np.ndarray | None = None,
                   mapped_from: int = MMAP_FROM_BYTES, unreused_share: float = UNREUSED_SHARE) -> tuple[int, int, int, int, int]:
    """`resident_parts`, and last what the resident set grows by with the heap-served transient bytes
    (bytes): those over the persistent peak where they live beside the persistent bytes (max over the
    step of persistent(t) + heap(t), less the persistent peak), and `unreused_share` of the rest of the
    heap-served transient peak. Where the largest activations are freed before gradients and optimizer
    state reach their peak, the heap serves those mostly from the freed chunks. vit-b16 at 112 px, fp32
    adamw: a heap-served transient peak of 58-232 MiB at batch 2-8 and 464 MiB at 16, yet 19-21 MiB
    over the persistent peak at 2-8 and 146 MiB at 16; a run at 8 measured 1676 MiB and three at 16
    1669-1689 (session 23's probe, bench/BENCHMARKS.calibration.md). Not all of it: mlp fp32
    sgd-momentum's runs rise 19, 24 and 43 MiB per doubling of the batch from 128 to 1024 where the
    bytes over the persistent peak rise 1, 5 and 13 MiB (session 25: 75-123 MiB free inside the heap
    after three steps, in chunks of tensors' sizes). A synthetic curve: the heap-served transient peak."""
    if len(curve) == 0:
        return 0, 0, 0, 0, 0
    persistent, heap, mapped = split_over_step(curve, None if synthetic else untouched, mapped_from)
    top = int(persistent.max())
    if synthetic:
        return top, int((heap + mapped).max()), 0, 0, int((heap + mapped).max())
    mapped = np.maximum(mapped, 0)
    heap_peak = int(heap.max())
    over = max(0, int((persistent + heap).max()) - top)
    return (top, heap_peak, int(mapped.max()), int((persistent + mapped).max()) - top,
            heap_term(heap_peak, over, unreused_share))


def split_over_step(curve: np.ndarray, untouched: np.ndarray | None = None,
                    mapped_from: int = MMAP_FROM_BYTES) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per event: (persistent live bytes, heap-served transient live bytes, mapped transient live
    bytes). Each event's allocation is the curve's step there; one of `mapped_from` bytes or more
    (glibc's default: MMAP_FROM_BYTES) is mapped. `untouched` (the trace's, per event): bytes a kernel never writes, which a mapping of
    their own keeps out of the resident set (taken off the mapped part)."""
    mask = np.zeros(curve.shape[1], dtype=bool)
    mask[list(PERSISTENT)] = True
    transient = curve[:, ~mask].sum(axis=1)
    step = np.diff(transient, prepend=0)
    own_mapping = np.abs(step) >= mapped_from
    mapped = np.cumsum(np.where(own_mapping, step, 0))
    heap = transient - mapped
    if untouched is not None:
        mapped = mapped - np.cumsum(np.where(own_mapping, untouched, 0))
    return curve[:, mask].sum(axis=1), heap, mapped


def touched_peak(curve: np.ndarray, untouched: np.ndarray | None = None) -> int:
    """The peak of live bytes that kernels have written (bytes): what the resident set cannot be
    below. Without untouched bytes, the live peak."""
    if len(curve) == 0:
        return 0
    total = curve.sum(axis=1)
    return int((total if untouched is None else total - np.cumsum(untouched)).max())

"""The terms of the CPU resident set in a traced curve: what glibc's heap serves, what it maps, what stays."""

from __future__ import annotations

import numpy as np

from advisor.estimate.batchmodel import BatchModel
from advisor.estimate.model import EstimateRequest
from advisor.estimate.strategy import PERSISTENT, scaled_curve
from advisor.procmem import MMAP_THRESHOLD_MAX

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
    peak (gradients set to None before the forward are not there when its large activations are).
    A synthetic curve (peak moments, not events) counts everything as heap-served. `untouched`,
    `mapped_from`: as in `split_over_step`. Evidence: bench/research/mapped_moments.py,
    bench/results/archive/mapped_moments.jsonl"""
    return resident_terms(curve, synthetic, untouched, mapped_from)[:4]


# The share of the heap-served transient peak under the persistent peak (bytes a perfect heap would serve
# again to gradients and optimizer state) that glibc's heap does not serve again: small allocations split and
# pin freed chunks apart. Over 54 recorded calibrations the error at the batch is flat from 0.2 to 0.3
# (10.2-10.4% at most), against 13.0% at 0 (full reuse) and 13.9% at 1 (no reuse).
# Evidence: bench/research/resident_probe.py (compare), bench/results/archive/resident_probe-grid.jsonl
UNREUSED_SHARE = 0.25


def heap_term(heap_peak: int, over: int, unreused_share: float = UNREUSED_SHARE) -> int:
    """The resident set's heap-served transient term (bytes): the bytes `over` the persistent peak, and
    `unreused_share` of the rest of the heap-served transient peak `heap_peak`."""
    return over + int(unreused_share * (heap_peak - over))


def resident_terms(curve: np.ndarray, synthetic: bool = False, untouched: np.ndarray | None = None,
                   mapped_from: int = MMAP_FROM_BYTES,
                   unreused_share: float = UNREUSED_SHARE) -> tuple[int, int, int, int, int]:
    """`resident_parts`, and last what the resident set grows by with the heap-served transient bytes
    (bytes): those over the persistent peak where they live beside the persistent bytes (max over the
    step of persistent(t) + heap(t), less the persistent peak), and `unreused_share` of the rest of the
    heap-served transient peak. Where the largest activations are freed before gradients and optimizer
    state reach their peak, the heap serves those mostly, not wholly, from the freed chunks.
    A synthetic curve: the heap-served transient peak."""
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
    (glibc's default: MMAP_FROM_BYTES) is mapped. `untouched` (the trace's, per event): bytes a kernel
    never writes, which a mapping of their own keeps out of the resident set (taken off the mapped part)."""
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


def batch_terms(req: EstimateRequest, bm: BatchModel, b: int,
                mapped_from: int = MMAP_FROM_BYTES) -> tuple[int, int, int, int, int]:
    """`resident_terms` of batch b's single-device curve."""
    tr = bm.at(b)
    return resident_terms(scaled_curve(req, tr, 1), tr.synthetic, tr.untouched, mapped_from)

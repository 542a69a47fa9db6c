"""Replay an allocation sequence through a model of PyTorch's CUDA caching allocator.

Rules from c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.x): sizes round up to 512 B; requests
of at most 1 MiB come from 2 MiB segments (small pool); larger ones from 20 MiB segments when
at most 10 MiB, else from a segment rounded up to 2 MiB; a free block is cached and reused
best-fit within its pool and split when the rest is large enough; nothing returns to the driver
without empty_cache(). max_memory_allocated counts rounded blocks; max_memory_reserved counts
segments. The CUDA context lives outside both (see RUNTIME_BYTES).
"""

from __future__ import annotations

import numpy as np

KB, MB = 1024, 1024 * 1024
SMALL_SIZE = 1 * MB
SMALL_BUFFER = 2 * MB
LARGE_BUFFER = 20 * MB
MIN_LARGE_ALLOC = 10 * MB
ROUND_LARGE = 2 * MB
MIN_BLOCK = 512

# CUDA context, kernels and cuBLAS/cuDNN handles outside the caching allocator, per device
# (bytes). Reported sizes range 300-600 MiB with CUDA 12 lazy module loading; not measured here.
RUNTIME_BYTES = 500 * MB


def _round(n: int) -> int:
    return max(MIN_BLOCK, (n + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK)


def _segment(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return (size + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE


def _should_split(rest: int, small: bool) -> bool:
    return rest >= MIN_BLOCK if small else rest > SMALL_SIZE


def simulate_cuda(sizes: np.ndarray, ids: np.ndarray) -> tuple[int, int]:
    """(peak allocated, peak reserved) bytes for (+size, id) allocations and (-size, id) frees."""
    free_blocks: dict[bool, list[int]] = {True: [], False: []}  # pool -> sizes of cached free blocks
    live: dict[int, tuple[bool, int]] = {}
    allocated = reserved = peak_alloc = peak_res = 0
    for size, key in zip(sizes.tolist(), ids.tolist()):
        if size <= 0:
            if key in live:
                small, block = live.pop(key)
                free_blocks[small].append(block)
                allocated -= block
            continue
        block = _round(size)
        small = block <= SMALL_SIZE
        pool = free_blocks[small]
        fits = [b for b in pool if b >= block]
        if fits:
            best = min(fits)
            pool.remove(best)
            if _should_split(best - block, small):
                pool.append(best - block)
            else:
                block = best
        else:
            seg = _segment(block)
            reserved += seg
            if seg - block > 0 and _should_split(seg - block, small):
                pool.append(seg - block)
            else:
                block = seg
        live[key] = (small, block)
        allocated += block
        peak_alloc = max(peak_alloc, allocated)
        peak_res = max(peak_res, reserved)
    return peak_alloc, peak_res

"""Replay an allocation sequence through a model of PyTorch's CUDA caching allocator.

Rules from c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.x): sizes round up to 512 B; requests
of at most 1 MiB come from 2 MiB segments (small pool); larger ones from 20 MiB segments when
at most 10 MiB, else from a segment rounded up to 2 MiB; a free block is cached and reused
best-fit within its pool and split when the rest is large enough; nothing returns to the driver
without empty_cache(). max_memory_allocated counts rounded blocks; max_memory_reserved counts
segments. Freed blocks merge with free neighbours in their segment. The CUDA context lives outside
both (see RUNTIME_BYTES).
"""

from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np

KB, MB = 1024, 1024 * 1024
SMALL_SIZE = 1 * MB
SMALL_BUFFER = 2 * MB
LARGE_BUFFER = 20 * MB
MIN_LARGE_ALLOC = 10 * MB
ROUND_LARGE = 2 * MB
MIN_BLOCK = 512

# CUDA context, kernels and cuBLAS/cuDNN handles outside the caching allocator, per device
# (bytes). Measured (NVML's memory for the process less memory_reserved, after three training
# steps; bench/estimate_accuracy_cuda.py) on an H100 80GB HBM3, driver 580.159, torch 2.11+cu130:
# 630-758 MiB over 54 cases, 758 for most (cuDNN loaded). Taken at the top: it decides what fits.
RUNTIME_BYTES = 760 * MB


# cuBLAS workspaces: torch gives each (thread, stream) that calls cuBLAS a handle with a workspace taken
# from the caching allocator, inside the first matrix product the thread runs, right after that op's
# output, and kept for the process's life. A training step has two threads (the forward's and
# optimizer's, and autograd's backward on its device thread); which of them call cuBLAS, and at which
# event, the trace says (Trace.cublas_threads, Trace.cublas_at: matrix products; convolutions go to
# cuDNN). Size per handle, torch's default (CublasHandlePool.cpp, CUBLAS_WORKSPACE_CONFIG unset): 32 MiB
# on compute capability 9.0 and later, else 4096 KiB x 2 + 16 KiB x 8. A matrix product that cuBLASLt
# runs (addmm with a bias vector: `linear`) also takes a cuBLASLt workspace for its thread: 1 MiB on
# an H100 and an H200 (torch 2.11).
# On an H100, max_memory_allocated exceeds the traced peak by 61-68 MB for the transformers and the
# recommender (2 x 32 MiB = 67 MB), and by none for the U-Net preset, which runs no matrix product.
# Evidence: bench/estimate_accuracy_cuda.py, bench/results/accuracy-cuda.json
# Where they are taken matters to the reserved peak: a workspace carved from a cached free block splits
# it, and a later request of that block's size then takes a new segment; with the workspaces taken where
# the real runs take them, real allocator events replayed through `simulate_cuda` give max_memory_reserved.
# Evidence: bench/research/cuda_events.py, bench/results/archive/cuda-events-h200
CUBLAS_HANDLES = 2
CUBLASLT_WORKSPACE = 1 * MB
HOPPER_OR_LATER = frozenset({"h100-sxm", "h100-pcie", "h200", "b200"})


def cublas_workspace_bytes(accelerator: str, handles: int = CUBLAS_HANDLES) -> int:
    """Bytes of cuBLAS workspace a training step leaves allocated on a device of this catalog key, when
    `handles` of its threads call cuBLAS."""
    per_handle = 32 * MB if accelerator in HOPPER_OR_LATER else 4096 * KB * 2 + 16 * KB * 8
    return handles * per_handle


def library_workspaces(accelerator: str, at: tuple[tuple[int, str], ...], threads: int) -> list[tuple[int | None, int]]:
    """(event index, bytes) of each library workspace a step takes on a device of this catalog key: one
    per ("cublas" or "cublaslt", event) the trace recorded (Trace.cublas_at), taken before that event;
    where the trace recorded none (an analytic trace, one loaded from disk) `threads` cuBLAS workspaces
    with no place (None: each in a segment of its own)."""
    sizes = {"cublas": cublas_workspace_bytes(accelerator, 1), "cublaslt": CUBLASLT_WORKSPACE}
    if at:
        return [(i, sizes[kind]) for i, kind in at]
    return [(None, cublas_workspace_bytes(accelerator, 1))] * threads


def with_workspaces(sizes: np.ndarray, ids: np.ndarray,
                    workspaces: list[tuple[int | None, int]]) -> tuple[np.ndarray, np.ndarray]:
    """`sizes` and `ids` (simulate_cuda's input) with each placed workspace allocated before its event and
    never freed (new ids past the trace's)."""
    placed = sorted(((i, n) for i, n in workspaces if i is not None), key=lambda w: w[0])  # stable: the trace's order
    if not placed:
        return sizes, ids
    where = np.array([i for i, _ in placed])
    first = int(ids.max()) + 1 if len(ids) else 0
    return (np.insert(sizes, where, [n for _, n in placed]),
            np.insert(ids, where, np.arange(first, first + len(placed), dtype=ids.dtype)))


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
    """(peak allocated, peak reserved) bytes for (+size, id) allocations and (-size, id) frees.

    Blocks live at offsets inside segments. A request takes the smallest cached free block of its
    pool that is large enough (lowest address among equals), split when the rest is large enough; a
    freed block merges with free neighbours in its segment, so later larger requests can reuse the
    room of several small ones, as the real allocator's free_block() does.
    """
    free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}  # pool -> sorted (size, segment, offset)
    blocks: dict[tuple[int, int], list] = {}  # (segment, offset) -> [size, is_free, small]
    ends: dict[tuple[int, int], int] = {}  # (segment, end offset) -> start offset
    live: dict[int, tuple[int, int]] = {}  # id -> (segment, offset)
    segments = allocated = reserved = peak_alloc = peak_res = 0

    def add_block(seg: int, off: int, size: int, is_free: bool, small: bool) -> None:
        blocks[(seg, off)] = [size, is_free, small]
        ends[(seg, off + size)] = off
        if is_free:
            insort(free[small], (size, seg, off))

    def drop_block(seg: int, off: int) -> list:
        blk = blocks.pop((seg, off))
        del ends[(seg, off + blk[0])]
        if blk[1]:
            pool = free[blk[2]]
            del pool[bisect_left(pool, (blk[0], seg, off))]
        return blk

    for size, key in zip(sizes.tolist(), ids.tolist()):
        if size <= 0:
            where = live.pop(key, None)
            if where is None:
                continue
            seg, off = where
            blk_size, _, small = drop_block(seg, off)
            allocated -= blk_size
            # merge with the free neighbours on either side
            nxt = blocks.get((seg, off + blk_size))
            if nxt is not None and nxt[1]:
                blk_size += drop_block(seg, off + blk_size)[0]
            prev_off = ends.get((seg, off))
            if prev_off is not None and blocks[(seg, prev_off)][1]:
                blk_size += drop_block(seg, prev_off)[0]
                off = prev_off
            add_block(seg, off, blk_size, True, small)
            continue
        want = _round(size)
        small = want <= SMALL_SIZE
        pool = free[small]
        i = bisect_left(pool, (want, -1, -1))
        if i < len(pool):
            have, seg, off = pool[i]
            drop_block(seg, off)
        else:
            have, seg, off = _segment(want), segments, 0
            segments += 1
            reserved += have
        if _should_split(have - want, small):
            add_block(seg, off + want, have - want, True, small)
        else:
            want = have
        add_block(seg, off, want, False, small)
        live[key] = (seg, off)
        allocated += want
        peak_alloc = max(peak_alloc, allocated)
        peak_res = max(peak_res, reserved)
    return peak_alloc, peak_res

"""Replay an allocation sequence through a model of glibc malloc to predict resident bytes.

Torch's CPU tensors come from posix_memalign (c10::alloc_cpu, 64-byte aligned). glibc serves a
request from a free hole (best fit) or the top of the heap; only when the top cannot grow in
place does a request at or above the mmap threshold get its own mmap. Freeing an mmapped chunk
raises the threshold to its size (up to 32 MiB) and the trim threshold to twice that, so after
the first large free most tensors live on the heap, where holes stay resident: that is the
"allocator overhead" a live-bytes count misses. Sources: glibc 2.36 malloc/malloc.c
(_int_malloc, sysmalloc, _int_free, systrim, __libc_free) and mallopt(3).
"""

from __future__ import annotations

import bisect

import numpy as np

PAGE = 4096
MINSIZE = 32
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit (bytes)
FASTBIN_CONSOLIDATION_THRESHOLD = 64 * 1024  # a free at least this large may trim the top (bytes)
TOP_PAD = 128 * 1024  # M_TOP_PAD default (bytes)


def _chunk(n: int) -> int:
    """Chunk bytes for a request of n bytes: 8-byte header, 16-byte granularity (request2size)."""
    return max(MINSIZE, (n + 8 + 15) & ~15)


def _pages(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


class GlibcHeap:
    """The main arena of glibc malloc, reduced to what decides resident bytes."""

    def __init__(self, mmap_threshold: int = 128 * 1024, dynamic: bool = True) -> None:
        self.mmap_threshold = mmap_threshold
        self.trim_threshold = 128 * 1024 if dynamic else 2 * mmap_threshold
        self.dynamic = dynamic
        self.starts: list[int] = []  # sorted start addresses of free holes
        self.hole: dict[int, int] = {}  # start -> size
        self.hole_by_end: dict[int, int] = {}  # end -> start
        self.top = 0  # start of the top chunk = end of the used heap (bytes)
        self.brk = 0  # program break (bytes from heap start)
        self.touched = 0  # highest byte ever handed out below brk: resident heap (bytes)
        self.mmapped = 0  # bytes in mmapped chunks (resident once written)
        self.chunks: dict[int, tuple[bool, int, int]] = {}  # id -> (mmapped, start, size)
        self.peak = 0

    def resident(self) -> int:
        return self.touched + self.mmapped

    def _take_hole(self, size: int) -> int | None:
        best = None
        for start in self.starts:
            s = self.hole[start]
            if s >= size and (best is None or s < self.hole[best]):
                best = start
                if s == size:
                    break
        if best is None:
            return None
        s = self._remove_hole(best)
        if s - size >= MINSIZE:
            self._add_hole(best + size, s - size)
        return best

    def _remove_hole(self, start: int) -> int:
        size = self.hole.pop(start)
        del self.hole_by_end[start + size]
        self.starts.pop(bisect.bisect_left(self.starts, start))
        return size

    def _add_hole(self, start: int, size: int) -> None:
        self.hole[start] = size
        self.hole_by_end[start + size] = start
        bisect.insort(self.starts, start)

    def malloc(self, key: int, n: int) -> None:
        size = _chunk(n)
        start = self._take_hole(size)
        if start is None and self.brk - self.top < size + MINSIZE and size >= self.mmap_threshold:
            mm = _pages(size + 64 + MINSIZE)
            self.chunks[key] = (True, 0, mm)
            self.mmapped += mm
        else:
            if start is None:
                if self.brk - self.top < size + MINSIZE:
                    self.brk = _pages(self.top + size + MINSIZE + TOP_PAD)
                start = self.top
                self.top += size
            self.chunks[key] = (False, start, size)
            self.touched = max(self.touched, start + size)
        self.peak = max(self.peak, self.resident())

    def free(self, key: int) -> None:
        mmapped, start, size = self.chunks.pop(key)
        if mmapped:
            self.mmapped -= size
            if self.dynamic and self.mmap_threshold < size <= MMAP_THRESHOLD_MAX:
                self.mmap_threshold = size
                self.trim_threshold = 2 * size
            return
        prev = self.hole_by_end.get(start)
        if prev is not None:
            size += self._remove_hole(prev)
            start = prev
        if start + size in self.hole:
            size += self._remove_hole(start + size)
        if start + size == self.top:
            self.top = start
        else:
            self._add_hole(start, size)
        if size >= FASTBIN_CONSOLIDATION_THRESHOLD and self.brk - self.top >= self.trim_threshold:
            self.brk = _pages(self.top + TOP_PAD)
            self.touched = min(self.touched, self.brk)


def simulate(sizes: np.ndarray, ids: np.ndarray, dynamic: bool = True) -> int:
    """Peak resident heap bytes for allocations (+size, id) and frees (-size, id) in order."""
    heap = GlibcHeap(dynamic=dynamic)
    for size, key in zip(sizes.tolist(), ids.tolist()):
        if size > 0:
            heap.malloc(key, size)
        elif key in heap.chunks:
            heap.free(key)
    return heap.peak

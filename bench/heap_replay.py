#!/usr/bin/env python
"""Offline: the traced allocations replayed through a small model of glibc's heap, beside real runs.

    .venv/bin/python bench/heap_replay.py [--runs K] [--slack BYTES] [--batches B,B,...] CASE
    CASE = workload:precision:optimizer:batch[:key=value,...]   e.g. vit-b16:fp32:sgd-momentum:16:image_size=112

Per batch size (the calibration's for the case's batch, and the batch; or --batches): K fresh-process
runs of DESIGN.md's CPU protocol (advisor.measure, one after another; 0 to skip them), and three
regressors from the estimator's fake trace (bytes, MiB in the output):
- `model`: the estimator's resident-set regressor at slope 1 (strategy.resident_parts: persistent peak
  + heap-served transient peak + what mapped transients add at their own moments);
- `coalesce` and `pinned`: the peak of heap extent + mapped live bytes when the trace's allocations
  are replayed, in order, through a main arena: best fit among free chunks, else the top chunk, else
  a mapping of its own for a request over glibc's dynamic mmap threshold (starting at 128 KiB, rising
  to each freed mapping up to 32 MiB), the top trimmed past the trim threshold (128 KiB, then twice the
  mmap threshold). `coalesce` merges a freed chunk with free neighbours, as glibc does; `pinned` never
  does, as if what the trace cannot see sat between tensors' chunks (small objects, and the fragments
  posix_memalign leaves before an aligned chunk, held in glibc's per-thread cache). `--slack`: bytes a
  reused free chunk must exceed the request by (posix_memalign's alignment: torch's CPU allocator aligns
  to 64).
A model that holds has real - regressor constant across the batch sizes: the calibration's intercept.
A tool for deciding the resident-set model, not a benchmark of a goal (bench/BENCHMARKS.calibration.md,
"Session 19").
"""

from __future__ import annotations

import argparse
import bisect
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from advisor.estimate.calibrate import MMAP_THRESHOLD_MIN, calibration_batches  # noqa: E402
from advisor.estimate.estimator import _batch_model, _make_request  # noqa: E402
from advisor.estimate.strategy import resident_parts, scaled_curve  # noqa: E402
from advisor.hardware import get_hardware  # noqa: E402
from advisor.measure import MeasureRequest, measure  # noqa: E402
from advisor.procmem import MMAP_THRESHOLD_MAX  # noqa: E402
from advisor.workload import load_workload  # noqa: E402
from mapped_moments import parse_case  # noqa: E402

MiB = 2**20


def chunk_bytes(n: int) -> int:
    """glibc's chunk for a request of n bytes: an 8-byte header, 16-byte granules, 32 bytes at least."""
    return max(32, (n + 8 + 15) // 16 * 16)


def replay(sizes: np.ndarray, ids: np.ndarray, *, coalesce: bool, slack: int = 0) -> int:
    """Peak over the events of heap extent + live mapped bytes (bytes). `sizes`: +bytes allocated,
    -bytes freed, per event; `ids`: the allocation each event is about (Trace.sizes, Trace.ids)."""
    heap = _Heap(coalesce, slack)
    peak = 0
    for size, ident in zip(sizes.tolist(), ids.tolist()):
        if size > 0:
            heap.allocate(ident, chunk_bytes(size))
        elif size < 0:
            heap.release(ident)
        peak = max(peak, heap.extent + heap.mapped)
    return peak


class _Heap:
    """glibc's main arena as `replay` models it: addresses are offsets from the heap's start."""

    def __init__(self, coalesce: bool, slack: int) -> None:
        self.coalesce, self.slack = coalesce, slack
        self.threshold = self.trim = MMAP_THRESHOLD_MIN  # glibc's initial values of both: 128 KiB
        self.starts: list[int] = []  # sorted addresses of free chunks
        self.free: dict[int, int] = {}  # address -> bytes
        self.live: dict[int, tuple[int, int]] = {}  # allocation -> (address, or -1 for a mapping; chunk bytes)
        self.top = self.extent = self.mapped = 0  # end of the chunks in use, end of the heap, mapped bytes

    def allocate(self, ident: int, need: int) -> None:
        fits = [a for a in self.starts if self.free[a] >= need + self.slack]
        if fits:  # best fit
            a = min(fits, key=self.free.__getitem__)
            rest = self._take(a) - need
            if rest >= 32:
                self._put(a + need, rest)
            else:
                need += rest
            self.live[ident] = (a, need)
        elif need >= self.threshold and self.extent - self.top < need:
            self.live[ident] = (-1, need)
            self.mapped += need
        else:
            self.live[ident] = (self.top, need)
            self.top += need
            self.extent = max(self.extent, self.top)

    def release(self, ident: int) -> None:
        if ident not in self.live:
            return
        a, n = self.live.pop(ident)
        if a < 0:
            self.mapped -= n
            if self.threshold < n <= MMAP_THRESHOLD_MAX:  # the dynamic threshold follows freed mappings
                self.threshold, self.trim = n, 2 * n
            return
        if self.coalesce:
            if a + n in self.free:
                n += self._take(a + n)
            i = bisect.bisect_left(self.starts, a)
            if i > 0 and self.starts[i - 1] + self.free[self.starts[i - 1]] == a:
                a = self.starts[i - 1]
                n += self._take(a)
        if a + n == self.top:  # into the top chunk, which glibc trims past its trim threshold
            self.top = a
            if self.extent - self.top >= self.trim:
                self.extent = self.top
        else:
            self._put(a, n)

    def _take(self, a: int) -> int:
        self.starts.remove(a)
        return self.free.pop(a)

    def _put(self, a: int, n: int) -> None:
        self.free[a] = n
        bisect.insort(self.starts, a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default: the calibration's and the case's)")
    ap.add_argument("--runs", type=int, default=2, help="real runs per batch size (0: none)")
    ap.add_argument("--slack", type=int, default=0)
    a = ap.parse_args()
    spec, prec, opt, batch, args = parse_case(a.case)
    batches = [int(b) for b in a.batches.split(",")] if a.batches else [*calibration_batches(batch), batch]
    req = _make_request(get_hardware("local"), batch, precision=prec, optimizer=opt, strategy="single",
                        checkpointing=False, fused_backward=False, offload_optimizer=False, offload_params=False,
                        optimizer_impl=None)
    bm = _batch_model(load_workload(spec, args), req, cpu=True)
    if bm.at(batch).synthetic:
        sys.exit(f"{a.case}: the traces differ between batch sizes (a data-dependent graph): no allocation sequence to replay")
    print(f"{a.case}: MiB; in brackets real - regressor")
    for b in batches:
        tr = bm.at(b)
        persistent, heap, _, over = resident_parts(scaled_curve(req, tr, 1), tr.synthetic, tr.untouched)
        regressors = {"model": persistent + heap + over,
                      "coalesce": replay(tr.sizes, tr.ids, coalesce=True, slack=a.slack),
                      "pinned": replay(tr.sizes, tr.ids, coalesce=False, slack=a.slack)}
        runs = [measure(MeasureRequest(workload=spec, workload_args=args, batch_size=b, precision=prec,
                                       optimizer=opt)).rss_delta_bytes for _ in range(a.runs)]
        real = float(np.median(runs)) if runs else None
        cols = " ".join(f"{k} {v / MiB:6.0f}" + (f" [{(real - v) / MiB:+5.0f}]" if real else "") for k, v in regressors.items())
        print(f"  b={b:<6d} real {'-' if real is None else f'{real / MiB:.0f}'} (runs {', '.join(f'{r / MiB:.0f}' for r in runs)})"
              f"  live peak {tr.peak_bytes / MiB:.0f}  {cols}", flush=True)


if __name__ == "__main__":
    main()

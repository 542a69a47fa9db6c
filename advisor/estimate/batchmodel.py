"""Memory as a function of batch size, from two traces whose op sequences match.

For almost every model each allocation's size is affine in the batch size (activations scale,
parameters do not), so two traces at batch sizes a < c give every allocation at any batch b by
interpolation, and the peak at b without tracing again: the allocations are matched by their
place in the allocation order, and replayed in trace a's order of events. (The order of frees
may differ between the two traces, e.g. when a kernel's path depends on the shape, without
changing what is allocated.) When the allocations themselves differ (the model's graph depends on
the batch), the candidate peak moments of the trace nearer the batch (in each phase of the step, its
overall peak and the peak of each category: activations, temporaries, ...) are scaled category by
category as that category's peak in that phase grows, and the largest taken: the moment that holds
the peak at a small batch (often the optimizer step) is not the one at a large batch (the end of the
forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Callable

import numpy as np

from advisor.estimate.cuda_reduce import scratch_slots
from advisor.estimate.strategy import PERSISTENT
from advisor.estimate.trace import Trace


@dataclass
class BatchModel:
    """Trace(b) for any batch b, from traces at a and c (c may be below a)."""

    a: int
    trace_a: Trace
    c: int | None = None
    trace_c: Trace | None = None
    retrace: Callable[[int], Trace] | None = None
    exact: dict[int, Trace] = field(default_factory=dict)  # batch sizes traced on their own
    # traces batch b on its own (the estimator's fake tracer), for `traced`; None: this model cannot
    tracer: Callable[[int], Trace] | None = None

    @staticmethod
    def _allocations(trace: Trace) -> np.ndarray:
        """Which events allocate: each allocation's first event. Not the sign of its size: an
        allocation may be 0 bytes in one trace and not in the other (a probed op's scratch,
        trace.Tracker.scratch)."""
        first = np.zeros(len(trace.ids), dtype=bool)
        first[np.unique(trace.ids, return_index=True)[1]] = True
        return first

    @cached_property
    def aligned(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None,
                               np.ndarray | None] | None:
        """(which of trace a's events allocate, category of each allocation, its size at a, its size at
        c, and its untouched bytes at a and at c or None), when both traces make the same allocations
        in the same order; else None. Computed once: at() runs for every step of the max-batch search."""
        ta, tc = self.trace_a, self.trace_c
        if tc is None or len(ta.sizes) != len(tc.sizes):
            return None
        alloc = self._allocations(ta)
        if not np.array_equal(alloc, self._allocations(tc)) or not np.array_equal(ta.ids[alloc], tc.ids[alloc]):
            return None
        n = int(ta.ids.max()) + 1 if len(ta.ids) else 0

        def per_alloc(events: np.ndarray, ids: np.ndarray) -> np.ndarray:
            out = np.zeros(n, np.int64)
            out[ids[alloc]] = events[alloc]
            return out

        # an allocation's category: the column its event moves in trace a's curve, or in c's where it is
        # 0 bytes in a
        def steps(t: Trace) -> np.ndarray:
            return np.diff(t.curve, axis=0, prepend=np.zeros((1, t.curve.shape[1]), np.int64))[alloc]

        step = steps(ta)
        step = np.where(np.any(step != 0, axis=1, keepdims=True), step, steps(tc))
        label = np.zeros(n, np.int64)
        label[ta.ids[alloc]] = np.argmax(np.abs(step), axis=1)
        untouched = (None, None) if ta.untouched is None or tc.untouched is None else (
            per_alloc(ta.untouched, ta.ids), per_alloc(tc.untouched, tc.ids))
        return alloc, label, per_alloc(ta.sizes, ta.ids), per_alloc(tc.sizes, tc.ids), *untouched

    def traced(self, b: int) -> Trace:
        """Batch b's own trace where this model can make one (`tracer`; kept in `exact`, so `at` returns it
        too), else `at(b)`: for comparisons with a real trace at b that must not rest on extrapolation. A
        batch's shapes need not be affine in its size (a graph batch's node count is the sum of its graphs'
        sizes: 1231, 2429 and 5000 nodes at 16, 32 and 64 in bench/workloads/fresh5.py:mpnn), and a fake
        trace carried from 8 and 16 to 4 would differ from a real one at 4 by the data, not the kernels."""
        if self.tracer is None or b in self.exact or b == self.a or (b == self.c and self.trace_c is not None):
            return self.at(b)
        self.exact[b] = self.tracer(b)
        return self.exact[b]

    def at(self, b: int) -> Trace:
        if b in self.exact:
            return self.exact[b]
        if b == self.a:
            return self.trace_a
        if b == self.c and self.trace_c is not None:
            return self.trace_c
        if self.aligned is None:
            if self.retrace is not None:
                return self.retrace(b)
            if self.trace_c is None:
                raise ValueError("batch model has one trace and cannot retrace")
            return self._peaks_at(b)
        ta = self.trace_a
        alloc, label, size_a, size_c, unt_a, unt_c = self.aligned
        f = (b - self.a) / (self.c - self.a)

        def interpolated(x_a: np.ndarray, x_c: np.ndarray, exact: dict[int, int] | None = None) -> np.ndarray:
            x = np.maximum(np.rint(x_a + f * (x_c - x_a)), 0).astype(np.int64)
            for aid, n in (exact or {}).items():
                x[aid] = n
            return np.where(alloc, x[ta.ids], -x[ta.ids])

        sizes = interpolated(size_a, size_c, self._reductions_at(f))
        onehot = np.zeros(ta.curve.shape, np.int64)
        onehot[np.arange(len(sizes)), label[ta.ids]] = sizes
        untouched = None if unt_a is None else \
            np.minimum(np.abs(interpolated(unt_a, unt_c)), np.abs(sizes)) * np.sign(sizes)
        # FLOPs scale with the batch (the second trace does not count them, to save time)
        return replace(ta, sizes=sizes, curve=np.cumsum(onehot, axis=0), untouched=untouched,
                       flops_per_step=int(round(ta.flops_per_step * b / self.a)))

    def _reductions_at(self, f: float) -> dict[int, int]:
        """Allocation id -> bytes of each reduction's scratch worked out for a CUDA target not at hand
        (Trace.reduce_specs), worked out again for the reduction at this batch: its blocks per output follow
        the launch grid, which is 0 below some size, has a ceiling and steps past it, so it is not affine in
        the batch as the tensors are."""
        ta, tc = self.trace_a, self.trace_c
        if not ta.reduce_specs or ta.reduce_gpu is None or tc is None:
            return {}
        theirs = {aid: spec for aid, _, spec in tc.reduce_specs}
        slots: dict[tuple, tuple[int, int, int] | None] = {}  # layers of one shape: worked out once (at() runs often)
        out = {}
        for aid, slot, spec in ta.reduce_specs:
            other = theirs.get(aid)
            if (spec, other) not in slots:
                here = spec.at(other, f) if other is not None else None
                slots[spec, other] = scratch_slots(here, ta.reduce_gpu) if here is not None else None
            if slots[spec, other] is not None:
                out[aid] = slots[spec, other][slot]
        return out

    @staticmethod
    def _candidates(curve: np.ndarray) -> np.ndarray:
        """Rows of `curve` that may hold a peak at another batch: the overall peak, the peaks of the
        long-lived categories together and of the rest together (the CPU resident-set model takes both,
        strategy.persistent_transient), then each category's; zeros for an empty curve."""
        if not len(curve):
            return np.zeros((3 + curve.shape[1], curve.shape[1]), np.int64)
        persistent = np.zeros(curve.shape[1], dtype=bool)
        persistent[list(PERSISTENT)] = True
        rows = [int(np.argmax(curve.sum(axis=1))), int(np.argmax(curve[:, persistent].sum(axis=1))),
                int(np.argmax(curve[:, ~persistent].sum(axis=1)))]
        return curve[rows + [int(np.argmax(col)) for col in curve.T]]

    @staticmethod
    def _phases(trace: Trace, phases: int) -> list[np.ndarray]:
        """The trace's curve cut at its phases (Trace.phases: the build, then each step's batch, forward,
        backward, optimizer step and after), each from the row before it begins; the whole curve where
        `phases` is 0."""
        if not phases:
            return [trace.curve]
        starts = np.searchsorted(trace.phases, np.arange(phases + 1))
        return [trace.curve[max(0, lo - 1):hi] for lo, hi in zip(starts, list(starts[1:]) + [len(trace.curve)])]

    def _peaks_at(self, b: int) -> Trace:
        """Two traces whose allocations differ (data-dependent graphs): the candidate peak rows
        (`_candidates`) of the trace nearer b in batch size, phase by phase, each category of a row
        scaled by how that category's peak in that phase grows from there to b (interpolated in batch
        size between the two traces' peaks in that phase), as the moments of a synthetic curve. A
        category's peak within one phase is the same moment at any batch size, and a row of one trace is
        one moment; rows of the two traces paired up would meet one moment with another where the peak
        moves (bench/workloads/fresh4.py's BiLSTM tagger peaks in the optimizer step at batch 4 and in the
        backward at 8). All rows are kept: the CPU resident set also takes the long-lived tensors' peak,
        which is not the largest row's."""
        ta, tc = self.trace_a, self.trace_c
        f = (b - self.a) / (self.c - self.a)
        same = ta.phases is not None and tc.phases is not None and len(ta.phases) and len(tc.phases) \
            and ta.phases[-1] == tc.phases[-1]
        phases = int(ta.phases[-1]) if same else 0
        near_c = abs(b - self.c) <= abs(b - self.a)
        moments = []
        for seg_a, seg_c in zip(self._phases(ta, phases), self._phases(tc, phases)):
            peak_a, peak_c = (s.max(axis=0) if len(s) else np.zeros(s.shape[1], np.int64) for s in (seg_a, seg_c))
            peak_b = np.maximum(peak_a + f * (peak_c - peak_a), 0)
            seg, peak = (seg_c, peak_c) if near_c else (seg_a, peak_a)
            moments.append(self._candidates(seg) * np.where(peak > 0, peak_b / np.maximum(peak, 1), 1.0))
        rows = np.rint(np.concatenate(moments)).astype(np.int64)
        return replace(ta, curve=rows, sizes=rows.sum(axis=1), ids=np.arange(len(rows), dtype=np.int64),
                       synthetic=True, untouched=None, cublas_at=(), phases=None)

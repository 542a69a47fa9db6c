"""Memory as a function of batch size, from two traces whose op sequences match.

For almost every model each allocation's size is affine in the batch size (activations scale,
parameters do not), so two traces at batch sizes a < c give every allocation at any batch b by
interpolation, and the peak at b without tracing again. When the sequences differ (the model's
graph depends on the batch), the two traces' peak moments are interpolated instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Callable

import numpy as np

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

    @cached_property
    def affine(self) -> bool:  # computed once: at() runs for every step of the max-batch search
        ta, tc = self.trace_a, self.trace_c
        return tc is not None and len(ta.ids) == len(tc.ids) and bool(np.array_equal(ta.ids, tc.ids))

    def at(self, b: int) -> Trace:
        if b in self.exact:
            return self.exact[b]
        if b == self.a:
            return self.trace_a
        if b == self.c and self.trace_c is not None:
            return self.trace_c
        if not self.affine:
            if self.retrace is not None:
                return self.retrace(b)
            if self.trace_c is None:
                raise ValueError("batch model has one trace and cannot retrace")
            return self._peaks_at(b)
        ta, tc = self.trace_a, self.trace_c
        f = (b - self.a) / (self.c - self.a)
        sizes = np.rint(ta.sizes + f * (tc.sizes - ta.sizes)).astype(np.int64)
        curve = np.rint(ta.curve + f * (tc.curve - ta.curve)).astype(np.int64)
        # FLOPs scale with the batch (the second trace does not count them, to save time)
        return replace(ta, sizes=sizes, curve=curve, flops_per_step=int(round(ta.flops_per_step * b / self.a)))

    def _peaks_at(self, b: int) -> Trace:
        """Two traces whose op sequences differ (data-dependent graphs): interpolate their peak rows."""
        ta, tc = self.trace_a, self.trace_c
        ra = ta.curve[int(np.argmax(ta.curve.sum(axis=1)))]
        rc = tc.curve[int(np.argmax(tc.curve.sum(axis=1)))]
        f = (b - self.a) / (self.c - self.a)
        row = np.maximum(np.rint(ra + f * (rc - ra)), 0).astype(np.int64)[None, :]
        return replace(ta, curve=row, sizes=np.asarray([int(row.sum())], np.int64), ids=np.zeros(1, np.int64),
                       synthetic=True)

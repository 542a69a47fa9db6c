"""Memory as a function of batch size, from two traces whose op sequences match.

For almost every model each allocation's size is affine in the batch size (activations scale,
parameters do not), so two traces at batch sizes a < c give every allocation at any batch b by
interpolation, and the peak at b without tracing again. When the sequences differ (the model's
graph depends on the batch), each query traces for real.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from advisor.estimate.trace import Trace


@dataclass
class BatchModel:
    """Trace(b) for any batch b, from traces at a and c (or by tracing each query)."""

    a: int
    trace_a: Trace
    c: int | None = None
    trace_c: Trace | None = None
    retrace: Callable[[int], Trace] | None = None

    @property
    def affine(self) -> bool:
        ta, tc = self.trace_a, self.trace_c
        return tc is not None and len(ta.ids) == len(tc.ids) and bool(np.array_equal(ta.ids, tc.ids))

    def at(self, b: int) -> Trace:
        if b == self.a:
            return self.trace_a
        if b == self.c and self.trace_c is not None:
            return self.trace_c
        if not self.affine:
            if self.retrace is None:
                raise ValueError("batch model has one trace and cannot retrace")
            return self.retrace(b)
        ta, tc = self.trace_a, self.trace_c
        f = (b - self.a) / (self.c - self.a)
        sizes = np.rint(ta.sizes + f * (tc.sizes - ta.sizes)).astype(np.int64)
        curve = np.rint(ta.curve + f * (tc.curve - ta.curve)).astype(np.int64)
        return replace(ta, sizes=sizes, curve=curve, flops_per_step=int(round(ta.flops_per_step + f * (tc.flops_per_step - ta.flops_per_step))))

"""The largest batch searched on exact traces (advisor/estimate/largest.py): pure, on a stand-in
memory curve whose steps no line through two batch sizes can follow (a kernel's workspace that
jumps when its algorithm changes with the shape)."""

from __future__ import annotations

from types import SimpleNamespace

from advisor.estimate.batchmodel import BatchModel
from advisor.estimate.largest import EXACT_TRACES, max_batch_on_traces

USABLE = 5200  # bytes, in this stand-in's units


def true_total(b: int) -> int:
    """30 bytes a sample, and a 700-byte workspace from batch 163 up: the largest that fits is 162."""
    return 30 * b + (700 if b >= 163 else 0)


def trace_at(b: int):
    return SimpleNamespace(total=true_total(b))  # stands in for a Trace: what fits_on and solve read


def fits_on(bm: BatchModel, b: int) -> bool:
    return bm.trace_a.total <= USABLE


def solve(bm: BatchModel) -> int:
    """The line through the model's two traced batch sizes, solved for USABLE (a batch model's answer)."""
    (a, ya), (c, yc) = (bm.a, bm.trace_a.total), (bm.c, bm.trace_c.total)
    slope = (ya - yc) / (a - c)
    return int(a + (USABLE - ya) / slope)


def test_the_answer_is_the_largest_batch_an_exact_trace_fits_past_a_step_the_line_misses():
    bm = BatchModel(a=64, trace_a=trace_at(64), c=32, trace_c=trace_at(32))
    first = solve(bm)
    assert first == 173 and true_total(first) > USABLE  # the line through 32 and 64 overshoots the step
    answer, traced = max_batch_on_traces(fits_on, solve, bm, trace_at, first)
    assert answer == 162
    assert all(fits_on(BatchModel(a=b, trace_a=trace_at(b)), b) == (b <= 162) for b in traced)
    assert len(traced) <= EXACT_TRACES


def test_an_answer_the_line_gets_right_costs_one_trace():
    def flat(b: int):
        return SimpleNamespace(total=30 * b)

    bm = BatchModel(a=64, trace_a=flat(64), c=32, trace_c=flat(32))
    answer, traced = max_batch_on_traces(fits_on, solve, bm, flat, solve(bm))
    assert answer == USABLE // 30 and traced == [USABLE // 30]


def test_the_largest_batch_search_reaches_its_limit():
    """A small model on a large GPU fits past 2**21 samples: the answer lies anywhere up to the limit (2**22),
    and fits there, rather than 2**21 where the doubling reaches the limit untested."""
    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory
    from advisor.estimate.evaluator import MAX_BATCH_LIMIT

    est = estimate_memory("mlp", "h200", EstimateRequest(batch_size=32768, precision="bf16"),
                          EstimateOptions(measured=False))
    assert MAX_BATCH_LIMIT // 2 < est.max_batch_size <= MAX_BATCH_LIMIT
    assert estimate_memory("mlp", "h200", EstimateRequest(batch_size=est.max_batch_size, precision="bf16"),
                           EstimateOptions(measured=False)).fits


def test_an_answer_at_the_search_limit_says_a_larger_batch_may_fit():
    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory
    from advisor.estimate.evaluator import MAX_BATCH_LIMIT

    capped = estimate_memory("tiny-mlp", "h200", EstimateRequest(batch_size=64), EstimateOptions(measured=False))
    assert capped.max_batch_size == MAX_BATCH_LIMIT
    assert any(f"at least {MAX_BATCH_LIMIT} (single)" in n for n in capped.notes)
    below = estimate_memory("tiny-mlp", "t4", EstimateRequest(batch_size=64), EstimateOptions(measured=False))
    assert below.max_batch_size < MAX_BATCH_LIMIT and not any("search's limit" in n for n in below.notes)

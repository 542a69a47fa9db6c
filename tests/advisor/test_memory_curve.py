"""memory_curve: one estimate, then its batch model's per-device memory at other batch sizes. At the estimate's
own batch a point is the estimate; elsewhere it agrees with an estimate made at that batch; the default batch
sizes bracket the largest batch that fits."""

from __future__ import annotations

import pytest

from advisor.errors import SpecError
from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory
from advisor.estimate.curve import MAX_POINTS, default_batch_sizes, memory_curve

OPTIONS = EstimateOptions(calibrate=False, measured=False)
ARGS = {"seq_len": 64}


def test_points_are_the_estimate_at_its_batch_and_agree_with_estimates_elsewhere():
    req = EstimateRequest(batch_size=8, precision="bf16")
    curve = memory_curve("tiny-gpt2", "l4", req, OPTIONS, [2, 8, 32], workload_args=ARGS)
    est = curve.estimate
    assert est == estimate_memory("tiny-gpt2", "l4", req, OPTIONS, workload_args=ARGS).model_copy(
        update={"seconds": est.seconds})
    assert [p.batch_size for p in curve.points] == [2, 8, 32]
    own = curve.points[1]
    assert (own.total_bytes, own.runtime_bytes, own.breakdown) == (est.total_bytes, est.runtime_bytes, est.breakdown)
    for p in curve.points:
        assert sum(p.breakdown.model_dump().values()) == p.total_bytes
        assert p.fits == (p.total_bytes + p.runtime_bytes <= est.usable_bytes)
    for p in (curve.points[0], curve.points[2]):  # the line against an estimate traced at that batch
        there = estimate_memory("tiny-gpt2", "l4", req.model_copy(update={"batch_size": p.batch_size}), OPTIONS,
                                workload_args=ARGS)
        assert p.total_bytes == pytest.approx(there.total_bytes, rel=0.02)
        assert p.breakdown.activations == pytest.approx(there.breakdown.activations, rel=0.02)
    activations = [p.breakdown.activations for p in curve.points]
    assert activations == sorted(activations) and activations[0] < activations[-1]


def test_default_batch_sizes_bracket_the_largest_batch():
    req = EstimateRequest(batch_size=4)
    curve = memory_curve("tiny-mlp", "l4", req, OPTIONS)
    est = curve.estimate
    batches = [p.batch_size for p in curve.points]
    assert batches == default_batch_sizes(est) and len(batches) <= MAX_POINTS
    assert est.max_batch_size > 4 and {1, 4, est.max_batch_size, est.max_batch_size + 1} <= set(batches)
    assert all(b & (b - 1) == 0 for b in batches if b not in (4, est.max_batch_size, est.max_batch_size + 1))
    nothing = est.model_copy(update={"max_batch_size": 0, "request": req.model_copy(update={"batch_size": 6})})
    assert default_batch_sizes(nothing) == [1, 2, 4, 6]


@pytest.mark.parametrize("batch_sizes, message", [([], "give 1 to"), ([4, 0], "batch size 0"),
                                                  (list(range(1, MAX_POINTS + 2)), "give 1 to")])
def test_bad_batch_sizes_are_spec_errors(batch_sizes, message):
    with pytest.raises(SpecError, match=message):
        memory_curve("tiny-mlp", "l4", EstimateRequest(batch_size=4), OPTIONS, batch_sizes)

"""Memory at any batch size from two traces (advisor/estimate/batchmodel.py), checked against a real
trace at that batch size. Under bf16 autocast the order of frees differs between batch sizes while
the allocations match: the model must still follow every allocation, not only the two peaks."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from advisor.config import OptimizerKind, Precision
from advisor.estimate.batchmodel import BatchModel
from advisor.estimate.cuda_alloc import simulate_cuda
from advisor.estimate.estimator import real_traces_note
from advisor.estimate.trace import trace_training
from advisor.workload import load_workload


def _trace(name: str, b: int, precision: Precision):
    return trace_training(load_workload(name, {}), b, precision=precision, optimizer=OptimizerKind.adamw,
                          count_flops=False)


@pytest.mark.parametrize("name,precision", [("tiny-bert", Precision.bf16), ("tiny-gpt2", Precision.bf16),
                                            ("tiny-lstm", Precision.fp32)])
def test_two_traces_predict_a_third_exactly(name, precision):
    a, c, far = (_trace(name, b, precision) for b in (2, 4, 32))
    bm = BatchModel(a=2, trace_a=a, c=4, trace_c=c)
    assert bm.aligned is not None
    got = bm.at(32)
    assert got.curve.sum(axis=1).max() == far.curve.sum(axis=1).max()
    assert np.array_equal(got.curve.max(axis=0), far.curve.max(axis=0))  # each category's peak too
    assert simulate_cuda(got.sizes, got.ids) == simulate_cuda(far.sizes, far.ids)
    # what an estimate says of such traces once the calibration takes them over a fake trace's
    fake = BatchModel(a=2, trace_a=a, c=4, trace_c=c, tracer=lambda b: far)
    assert real_traces_note(fake, bm, 32).endswith("batch sizes 2 and 4, extrapolated per allocation")


def test_unmatched_allocations_still_grow_with_the_batch():
    # traces whose allocations cannot be matched fall back to candidate moments: at a large batch
    # the forward's activations, not the small batch's optimizer-step peak, must decide
    a, c, far = (_trace("tiny-gpt2", b, Precision.fp32) for b in (2, 4, 64))
    c = replace(c, sizes=c.sizes[:-1], ids=c.ids[:-1], curve=c.curve[:-1])
    bm = BatchModel(a=2, trace_a=a, c=4, trace_c=c)
    assert bm.aligned is None
    got = bm.at(64).curve.sum(axis=1).max()
    exact = far.curve.sum(axis=1).max()
    # 16x past the traces, the moments' mix of categories drifts: over, never far under
    assert 0.98 * exact <= got <= 1.10 * exact
    # the CPU resident-set model's two terms: the long-lived tensors' peak is the optimizer step's,
    # not the live peak's moment (where the gradients do not exist yet)
    from advisor.estimate.strategy import persistent_transient

    persistent, transient = persistent_transient(bm.at(64).curve)
    exact_persistent, exact_transient = persistent_transient(far.curve)
    assert persistent == pytest.approx(exact_persistent, rel=0.01)
    assert 0.98 * exact_transient <= transient <= 1.15 * exact_transient  # the same drift, as above


def test_a_data_dependent_graphs_peak_moves_between_phases_and_is_followed_there():
    # A BiLSTM tagger over packed sequences: real traces (fake tensors cannot run pack_padded_sequence)
    # whose allocations differ with the batch. Its live peak is in the optimizer step at 4 and at the end
    # of the forward from 8 up; rows of the two traces paired as moments put it 28% over at 16, where
    # each phase's rows of the trace at 8, scaled as each category's peak in that phase grows, follow it.
    from pathlib import Path

    wl = load_workload(f"{Path(__file__).with_name('packed_tagger.py')}:build", {})
    a, c, far = (trace_training(wl, b, precision=Precision.fp32, optimizer=OptimizerKind.adamw, fake=False,
                                count_flops=False) for b in (4, 8, 16))
    bm = BatchModel(a=4, trace_a=a, c=8, trace_c=c)
    assert bm.aligned is None, "the traces' allocations differ"
    assert a.phases is not None and a.phases[-1] == c.phases[-1] == far.phases[-1] == 10  # build + 2 x 5
    got = bm.at(16)
    # the batch's tokens (129, 238 and 470 at 4, 8 and 16) extrapolate 3% under: so do the activations
    assert 0.93 * far.peak_bytes <= got.peak_bytes <= 1.03 * far.peak_bytes
    from advisor.estimate.strategy import persistent_transient

    assert persistent_transient(got.curve)[0] == pytest.approx(persistent_transient(far.curve)[0], rel=0.01)
    # an estimate whose calibration took these over the real-step fallback's traces at 1 and 2 says so, and
    # that the peak at 16 is extrapolated phase by phase, which a count the data sets may not follow
    fallback = BatchModel(a=1, trace_a=a, c=2, trace_c=c)
    note = real_traces_note(fallback, bm, 16)
    assert note.startswith("traced again on real steps at batch sizes 4 and 8") and "phase by phase" in note
    assert "phase by phase" not in real_traces_note(fallback, bm, 8)  # a batch traced is not extrapolated


def test_largest_batch_does_not_depend_on_the_batch_asked_about():
    from advisor.estimate import estimate_memory
    from advisor.hardware import get_hardware

    hw = get_hardware("cpu").model_copy(update={"host_memory_bytes": 2 << 30})
    got = {b: estimate_memory("tiny-bert", hw, b, precision="bf16", calibrate=False, measured=False,
                              workload_args={"seq_len": 512}).max_batch_size for b in (2, 16)}
    assert got[2] == got[16] > 16


def test_a_trace_does_not_depend_on_what_the_process_ran_before():
    # FakeTensorMode's dispatch cache rebuilt the LSTM backward's two bias gradients (one tensor from the
    # kernel) as two on its second run of a shape, so the first trace in a process differed from later ones
    # and, after other traces, two batch sizes' traces no longer matched (trace._aliased_as_the_kernel).
    # Batch 5: a shape no other test traces, so the first of these two runs its ops uncached.
    first, again = (_trace("tiny-lstm", 5, Precision.fp32) for _ in range(2))
    assert np.array_equal(first.sizes, again.sizes)
    assert np.array_equal(first.ids, again.ids)

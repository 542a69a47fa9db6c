"""Memory at any batch size from two traces (advisor/estimate/batchmodel.py), checked against a real
trace at that batch size. Under bf16 autocast the order of frees differs between batch sizes while
the allocations match: the model must still follow every allocation, not only the two peaks."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from advisor.config import OptimizerKind, Precision
from advisor.estimate.batchmodel import BatchModel
from advisor.estimate.cuda_alloc import simulate_cuda
from advisor.estimate.resident.measured import real_traces_note
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
    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory
    from advisor.hardware import get_hardware

    hw = get_hardware("cpu").model_copy(update={"host_memory_bytes": 2 << 30})
    got = {b: estimate_memory("tiny-bert", hw, EstimateRequest(batch_size=b, precision="bf16"),
                              EstimateOptions(calibrate=False, measured=False),
                              workload_args={"seq_len": 512}).max_batch_size for b in (2, 16)}
    assert got[2] == got[16] > 16


def test_where_16_bit_products_hold_scratch_the_largest_batch_is_one_an_exact_trace_fits(monkeypatch):
    # Where this CPU's bf16 matrix products hold scratch inside oneDNN (scratch_cpu.is_half_product), the scratch is not
    # affine in the batch: on an AMX Xeon the answer above is 146 at one batch asked about and 149 at the other.
    # There the answer is searched again on exact traces: one whose own trace fits, where the next
    # batch's does not. The trace probes a dtype's products where its buffer is at least half the output, as on
    # AMX (scratch_cpu.PRODUCT_SCRATCH_SHARE); any buffer at all here, so that the search runs on a CPU whose products
    # hold a little (a Zen 4's 26 KiB beside 512 KiB).
    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory, estimator, scratch_cpu
    from advisor.hardware import get_hardware

    if not _half_products_hold_scratch(torch.bfloat16, share=0.0):
        pytest.skip("this CPU's bf16 matrix products hold nothing beside their output: no scratch to search on")
    monkeypatch.setattr(scratch_cpu, "PRODUCT_SCRATCH_SHARE", 0.0)
    monkeypatch.setattr(estimator, "_TRACES", estimator._TRACES.__class__())  # none kept from before the patch
    hw = get_hardware("cpu").model_copy(update={"host_memory_bytes": 2 << 30})

    def at(b: int):
        return estimate_memory("tiny-bert", hw, EstimateRequest(batch_size=b, precision="bf16"),
                               EstimateOptions(calibrate=False, measured=False), workload_args={"seq_len": 512})

    asked = {b: at(b) for b in (2, 16)}
    got = {b: e.max_batch_size for b, e in asked.items()}
    assert got[2] == got[16] > 16
    assert all(any("16-bit matrix products' scratch probed at each" in n for n in e.notes)
               for e in asked.values()), asked[2].notes
    assert (at(got[2]).fits, at(got[2] + 1).fits) == (True, False)

    # A caller that needs only the request's own batch and the line's largest batch: two traces, not the search's
    # (up to 8 more, each probing every product), the same total, and a note that the largest batch is the line's.
    from advisor.trial import TrainingConfig
    from search_spaces import feasibility

    traced: list[int] = []

    def counted(wl, b, **kw):
        traced.append(b)
        return trace_training(wl, b, **kw)

    monkeypatch.setattr(estimator, "trace_training", counted)
    estimator._TRACES.clear()  # the search's traces above would serve these
    line = estimate_memory("tiny-bert", hw, EstimateRequest(batch_size=2, precision="bf16"),
                           EstimateOptions(calibrate=False, measured=False, exact_largest=False),
                           workload_args={"seq_len": 512})
    assert sorted(traced) == [2, 4] and (line.total_bytes, line.fits) == (asked[2].total_bytes, asked[2].fits)
    assert any("not searched again on exact traces" in n for n in line.notes), line.notes
    traced.clear()
    # a workload object is estimated in this process (a name, in an isolated worker), so its traces count here
    from advisor.workload import load_workload

    bert = load_workload("tiny-bert", {"seq_len": 512})
    # the tuner's pruning decides one batch: one trace, the same total, no largest batch
    feas = feasibility(bert, None, hw, TrainingConfig(batch_size=2, precision="bf16"), None)
    assert feas.launch and sorted(traced) == [2], traced
    assert (feas.total_bytes, feas.max_batch_size, feas.estimate.max_batch_size) == (line.total_bytes, None, None)
    assert any("largest batch not asked for" in n for n in feas.estimate.notes), feas.estimate.notes


@pytest.mark.parametrize("share", [None, 0.0])
def test_the_16_bit_products_of_a_dtype_that_holds_scratch_here_are_probed(share, monkeypatch):
    # a bf16 and an fp16 trace for this CPU: products counted as holding scratch where this CPU's products of that
    # dtype hold a buffer of at least scratch_cpu.PRODUCT_SCRATCH_SHARE of their output (the default, None, and any
    # buffer, 0.0). The trace probes only those dtypes: a Zen 4's fp16 products hold nothing and run slowly, and
    # probing them takes gpt2-small b4's fp16 trace past ten minutes.
    from advisor.estimate import scratch_cpu

    if share is not None:
        monkeypatch.setattr(scratch_cpu, "PRODUCT_SCRATCH_SHARE", share)
    for precision, dtype in ((Precision.bf16, torch.bfloat16), (Precision.fp16, torch.float16)):
        tr = trace_training(load_workload("tiny-gpt2", {}), 4, precision=precision, optimizer=OptimizerKind.adamw,
                            cpu_workspaces=True, count_flops=False)
        holds = _half_products_hold_scratch(dtype, share=scratch_cpu.PRODUCT_SCRATCH_SHARE)
        assert (tr.probed_products > 0) == holds, (precision, share, tr.probed_products)


def _half_products_hold_scratch(dtype: torch.dtype, share: float) -> bool:
    """Whether one of this CPU's 16-bit matrix products, a skinny one (a linear layer's input gradient) or a square
    one, allocates more than its output through torch's allocator, by at least `share` of the output: an AMX CPU's
    kernels hold buffers that grow with the product (its fp16 ones only beside the square product), a Zen 4's bf16
    ones about 258 KiB whatever the product."""
    from torch.profiler import ProfilerActivity, profile

    from advisor.measure import memory_events

    for m, k, n in ((32, 10, 8192), (512, 768, 768)):
        a, b = torch.zeros(m, k, dtype=dtype), torch.zeros(k, n, dtype=dtype)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = torch.mm(a, b)
            del out
        extra = sum(x for x in memory_events(prof) if x > 0) - m * n * dtype.itemsize
        if extra > 0 and extra >= share * m * n * dtype.itemsize:
            return True
    return False


def test_a_trace_does_not_depend_on_what_the_process_ran_before():
    # FakeTensorMode's dispatch cache rebuilds the LSTM backward's two bias gradients (one tensor from the
    # kernel) as two on its second run of a shape; uncorrected, the first trace in a process differs from later
    # ones and, after other traces, two batch sizes' traces do not match (fake_ops.aliased_as_the_kernel).
    # Batch 5: a shape no other test traces, so the first of these two runs its ops uncached.
    first, again = (_trace("tiny-lstm", 5, Precision.fp32) for _ in range(2))
    assert np.array_equal(first.sizes, again.sizes)
    assert np.array_equal(first.ids, again.ids)


@pytest.fixture
def traced(monkeypatch) -> list[int]:
    """The batch sizes the estimator traces from here on, with no step kept from before."""
    from advisor.estimate import estimator

    monkeypatch.setattr(estimator, "_TRACES", estimator._TRACES.__class__())
    batches: list[int] = []

    def counted(wl, b, **kw):
        batches.append(b)
        return trace_training(wl, b, **kw)

    monkeypatch.setattr(estimator, "trace_training", counted)
    return batches


def test_estimates_of_a_preset_share_its_traces_and_answer_as_a_fresh_trace_would(traced):
    # A tuner's isolated worker estimates one batch size after another, and the batch model traces b beside 2b or
    # b/2: batch 4 after 2 and 8 traces nothing new, and answers exactly as where nothing was kept.
    from pathlib import Path

    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory, estimator

    def at(b: int, workload: str = "tiny-gpt2", args: dict | None = None):
        return estimate_memory(workload, "cpu", EstimateRequest(batch_size=b), EstimateOptions(
            calibrate=False, measured=False, exact_largest=False), workload_args=args or {"seq_len": 64})

    at(2), at(8)  # traces 2 and 4, then 8 beside the 4 kept
    assert sorted(traced) == [2, 4, 8]
    kept = at(4)
    assert sorted(traced) == [2, 4, 8], "batch 4 and its neighbour 2 were kept"
    estimator._TRACES.clear()
    fresh = at(4)
    assert sorted(traced) == [2, 2, 4, 4, 8]
    assert (kept.total_bytes, kept.max_batch_size, kept.flops_per_step) == \
        (fresh.total_bytes, fresh.max_batch_size, fresh.flops_per_step) and kept.flops_per_step > 0
    with pytest.raises(ValueError, match="read-only"):  # kept traces are shared: no caller may write into one
        next(iter(estimator._TRACES.values())).sizes[0] = 0
    # a workload file may be edited between two estimates: its steps are traced each time
    traced.clear()
    pooled = f"{Path(__file__).with_name('pooled_mean.py')}:build"
    at(2, pooled, {"points": 16}), at(2, pooled, {"points": 16})
    assert sorted(traced) == [2, 2, 4, 4]


def test_a_decision_on_one_batch_traces_that_batch_alone_and_a_batch_that_does_not_fit_names_the_largest(traced):
    # The tuner's pruning (largest=False) traces the configuration's own batch and answers its total as the
    # two-trace estimate does; a batch that does not fit is estimated again for the largest batch its reason names.
    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory
    from advisor.hardware import get_hardware
    from advisor.trial import TrainingConfig
    from search_spaces import feasibility
    from search_spaces.prune import FEASIBILITY_CACHE

    FEASIBILITY_CACHE.clear()
    gpt2, gpu = load_workload("tiny-gpt2", {"seq_len": 64}), get_hardware("tiny")  # a 1 GiB GPU
    fits = feasibility(gpt2, None, gpu, TrainingConfig(device="cuda", batch_size=8), 0.05)
    assert fits.launch and traced == [8] and fits.max_batch_size is None
    both = estimate_memory(gpt2, gpu, EstimateRequest(batch_size=8), EstimateOptions(calibrate=False, margin=0.05))
    assert both.total_bytes == fits.total_bytes and both.max_batch_size > 8 and sorted(traced) == [4, 8, 8]
    traced.clear()
    big = 4 * both.max_batch_size
    pruned = feasibility(gpt2, None, gpu, TrainingConfig(device="cuda", batch_size=big), 0.05)
    assert not pruned.launch and traced == [big, big, big // 2], traced  # a workload object's steps are not kept
    assert 0 < pruned.max_batch_size < big and f"largest batch that fits: {pruned.max_batch_size}" in pruned.reason


def test_the_tuners_pruning_reads_a_batch_off_the_line_through_two_kept_traces(traced):
    # The tuner asks batch after batch of one step (EstimateOptions.line): once two batches are traced, a third is
    # read off their line, exactly as its own trace says; batch 1, a batch the line says does not fit, and a step
    # whose kernels' scratch departs from the line (16-bit products on a CPU whose products hold scratch) are traced.
    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory, estimator
    from advisor.estimate.notes import exact_largest_reason
    from advisor.hardware import get_hardware
    from advisor.trial import TrainingConfig
    from search_spaces import feasibility

    cpu = get_hardware("cpu")

    def at(b: int, precision: str = "fp32", line: bool = True, hw=cpu):
        return estimate_memory("tiny-gpt2", hw, EstimateRequest(batch_size=b, precision=precision), EstimateOptions(
            calibrate=False, measured=False, margin=0.0, largest=False, line=line), workload_args={"seq_len": 64})

    at(2), at(16)
    mid = at(8)
    assert traced == [2, 16] and any("batch 8 read off the line through the step's traces at 2 and 16" in n
                                     for n in mid.notes), mid.notes
    own = at(8, line=False)
    assert traced == [2, 16, 8] and (mid.total_bytes, mid.runtime_bytes) == (own.total_bytes, own.runtime_bytes)
    assert mid.flops_per_step == own.flops_per_step > 0
    at(1)
    assert traced[-1] == 1
    # the line's batch 64 does not fit a host of a MiB less: batch 64 is traced, and does not fit
    far = at(64)
    assert traced[-1] == 1 and far.fits
    tight = at(64, hw=cpu.model_copy(update={"host_memory_bytes": far.total_bytes + far.runtime_bytes - 2**20}))
    assert traced[-1] == 64 and not tight.fits and tight.total_bytes == far.total_bytes
    # bf16: read off the line unless this CPU's 16-bit products hold scratch that is not affine in the batch
    traced.clear()
    at(2, "bf16"), at(16, "bf16"), at(8, "bf16")
    kept = [t for (key, b), t in estimator._TRACES.items() if "Precision.bf16" in key[1] and b in (2, 16)]
    assert len(kept) == 2
    assert traced == [2, 16, 8] if any(exact_largest_reason(t, True) for t in kept) else traced == [2, 16]
    # the tuner's pruning asks so, in its isolated worker
    decided = [feasibility("tiny-gpt2", {"seq_len": 48}, cpu, TrainingConfig(batch_size=b), None) for b in (2, 16, 8)]
    assert all(d.launch for d in decided)
    assert any("read off the line" in n for n in decided[2].estimate.notes), decided[2].estimate.notes
    assert not any("read off the line" in n for d in decided[:2] for n in d.estimate.notes)

"""Pruning before running: the estimate keeps what cannot fit from launching (cached per memory
case), and an OOM rules out larger batches with the same other knobs."""

from __future__ import annotations

import pytest

from advisor.hardware import get_hardware
from advisor.trial import TrainingConfig
from search_spaces import OomFrontier, feasibility
from search_spaces.prune import FEASIBILITY_CACHE, memory_key

WORKLOAD = "tiny-gpt2"  # a GPT-2 shaped decoder small enough to trace quickly


@pytest.fixture(scope="module")
def tiny_gpu():
    return get_hardware("tiny")  # a 1 GiB GPU from the catalog


def test_a_batch_that_cannot_fit_is_pruned_and_one_that_fits_launches(tiny_gpu):
    FEASIBILITY_CACHE.clear()
    small = feasibility(WORKLOAD, {}, tiny_gpu, TrainingConfig(device="cuda", batch_size=8), 0.05)
    assert small.launch and small.reason.startswith("fits")
    assert small.total_bytes + small.runtime_bytes <= small.usable_bytes
    assert small.usable_bytes == int(tiny_gpu.accelerator.memory_bytes * 0.95)
    huge = feasibility(WORKLOAD, {}, tiny_gpu, TrainingConfig(device="cuda", batch_size=4096), 0.05)
    assert not huge.launch and "exceeds" in huge.reason
    assert huge.total_bytes > huge.usable_bytes
    assert 8 <= huge.max_batch_size < 4096
    assert f"largest batch that fits: {huge.max_batch_size}" in huge.reason


def test_the_estimate_is_cached_per_memory_case(tiny_gpu):
    FEASIBILITY_CACHE.clear()
    base = TrainingConfig(device="cuda", batch_size=16)
    first = feasibility(WORKLOAD, {}, tiny_gpu, base, 0.05)
    assert (FEASIBILITY_CACHE.hits, FEASIBILITY_CACHE.misses) == (0, 1)
    # Input-pipeline knobs do not change the estimate: no new trace. (compile_mode does: measured
    # peaks refine the estimate per compile mode.)
    other = TrainingConfig(device="cuda", batch_size=16, num_workers=4, pin_memory=True)
    assert feasibility(WORKLOAD, {}, tiny_gpu, other, 0.05) is first
    assert (FEASIBILITY_CACHE.hits, FEASIBILITY_CACHE.misses) == (1, 1)
    bf16 = feasibility(WORKLOAD, {}, tiny_gpu, TrainingConfig(device="cuda", batch_size=16, precision="bf16"), 0.05)
    assert FEASIBILITY_CACHE.misses == 2 and bf16.estimate.allocated_bytes != first.estimate.allocated_bytes
    assert first.max_batch_size is None, "a batch that fits is not searched past"
    feasibility(WORKLOAD, {}, tiny_gpu, base, 0.5)  # another margin is another decision
    assert FEASIBILITY_CACHE.misses == 3


def _cfg(**kw) -> TrainingConfig:
    return TrainingConfig(device="cuda", **kw)


def test_an_oom_blocks_larger_batches_with_the_same_other_knobs():
    frontier = OomFrontier()
    assert frontier.blocks(_cfg(batch_size=64)) is None
    frontier.record_oom(_cfg(batch_size=64, precision="bf16"))
    assert len(frontier) == 1
    assert "64" in frontier.blocks(_cfg(batch_size=64, precision="bf16"))
    assert "ran out of memory" in frontier.blocks(_cfg(batch_size=128, precision="bf16"))
    assert frontier.blocks(_cfg(batch_size=32, precision="bf16")) is None
    assert frontier.blocks(_cfg(batch_size=128, precision="fp32")) is None  # other knobs differ
    assert frontier.blocks(_cfg(batch_size=128, precision="bf16", checkpointing=True)) is None


def test_accumulation_only_blocks_at_least_as_much_accumulation():
    frontier = OomFrontier()
    frontier.record_oom(_cfg(batch_size=64, grad_accum=2))
    assert frontier.blocks(_cfg(batch_size=128, grad_accum=1)) is None  # gradients not kept alive
    assert frontier.blocks(_cfg(batch_size=64, grad_accum=4)) is not None
    frontier.record_oom(_cfg(batch_size=32, grad_accum=1))
    assert frontier.blocks(_cfg(batch_size=32, grad_accum=2)) is not None


def test_a_measured_peak_added_since_decides_again(tiny_gpu, tmp_path, monkeypatch):
    # A trial's measured peak (probes/protocol.py on the CPU, the runner on CUDA) refines the estimate
    # the cached decision rests on, so the next draw of that memory case is decided again. A data dir
    # of its own: the point below must refine no other test's estimate.
    from advisor.estimate.model import EstimateRequest
    from advisor.peaks import record_measured_peak
    from advisor.settings import get_settings
    from advisor.workload import load_workload

    monkeypatch.setenv("ADVISOR_DATA_DIR", str(tmp_path))
    get_settings.cache_clear()
    try:
        FEASIBILITY_CACHE.clear()
        config = TrainingConfig(device="cuda", batch_size=16)
        before = feasibility(WORKLOAD, {}, tiny_gpu, config, 0.05)
        assert before.launch and feasibility(WORKLOAD, {}, tiny_gpu, config, 0.05) is before
        # measured: the whole device's memory at this batch (a peak the estimate did not foresee)
        record_measured_peak(load_workload(WORKLOAD), tiny_gpu, EstimateRequest(batch_size=16), "none",
                             tiny_gpu.accelerator.memory_bytes, "cuda_reserved", before.total_bytes)
        after = feasibility(WORKLOAD, {}, tiny_gpu, config, 0.05)
        assert FEASIBILITY_CACHE.misses == 2 and not after.launch and "exceeds" in after.reason
    finally:
        get_settings.cache_clear()
        FEASIBILITY_CACHE.clear()


def test_a_trial_and_its_pruning_estimate_one_world(tiny_gpu):
    # A trial of 2 devices on a 4-device machine: the trial's prediction (probes.runner) and the
    # pruning decision both estimate for the 2 devices it runs on (advisor.trial.trial_hardware), so
    # ZeRO-3 shards over 2, not over the machine's 4.
    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory
    from probes.runner import _estimate

    four = tiny_gpu.model_copy(update={"devices_per_node": 4})
    config = TrainingConfig(device="cuda", batch_size=8, nproc=2, strategy="zero3")
    predicted, note = _estimate(WORKLOAD, {}, config, four)
    assert note is None
    assert predicted.total_bytes == feasibility(WORKLOAD, {}, four, config, 0.05).total_bytes
    over_four = estimate_memory(WORKLOAD, four, EstimateRequest(batch_size=8, strategy="zero3"),
                                EstimateOptions(calibrate=False))
    assert predicted.total_bytes > over_four.total_bytes  # sharded over 2 holds more per device than over 4


def test_a_layout_that_cannot_fit_is_pruned_by_its_per_rank_estimate():
    # tp 2 x pp 2 on four 1 GiB GPUs: the per-pipeline-rank estimate (advisor.estimate.parallel) decides, not
    # the one-device estimate, and the reason names the fullest rank and the layout.
    from advisor.estimate.parallel import estimate_layout
    from advisor.trial import estimate_request, trial_hardware

    four = get_hardware("tiny:4")
    FEASIBILITY_CACHE.clear()
    huge = TrainingConfig(device="cuda", batch_size=8192, tp=2, pp=2, nproc=4, microbatches=4)
    pruned = feasibility("tiny-decoder", {}, four, huge, 0.05)
    assert not pruned.launch
    assert "exceeds" in pruned.reason and "pipeline rank" in pruned.reason
    assert pruned.reason.endswith("layout dp1 tp2 pp2 1f1b x4 mb")
    est = estimate_layout("tiny-decoder", trial_hardware(four, huge), huge.layout(), estimate_request(huge),
                          margin=0.05)
    assert not est.fits and pruned.total_bytes == est.peak.total_bytes and pruned.usable_bytes == est.usable_bytes
    assert f"pipeline rank {est.peak.stages[0]}" in pruned.reason
    small = huge.model_copy(update={"batch_size": 8})
    fits = feasibility("tiny-decoder", {}, four, small, 0.05)
    assert fits.launch and fits.reason.startswith("fits")
    # the layout's knobs are part of the memory case: another split is another estimate
    assert memory_key(small) != memory_key(small.model_copy(update={"microbatches": 8}))
    assert memory_key(small) != memory_key(TrainingConfig(device="cuda", batch_size=8, tp=4, nproc=4))

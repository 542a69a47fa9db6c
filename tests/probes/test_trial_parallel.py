"""Tensor- and pipeline-parallel trials on real gloo ranks of this CPU: every rank reports its figures and the
collectives it ran, and a layout that cannot run is refused in one line before anything starts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from advisor.parallel.layout import Layout
from advisor.trial import TrainingConfig, TrialBudget, TrialStatus
from probes.runner import run_trial

ROOT = Path(__file__).resolve().parents[2]
QUICK = TrialBudget(warmup_steps=1, min_steps=2, min_time_s=0.0, timeout_s=120, settle_s=0, record_peak="never")


@pytest.fixture(scope="module")
def tp_trial():
    return run_trial("tiny-llama", {"nproc": 2, "tp": 2, "batch_size": 4}, hardware="cpu", budget=QUICK,
                     estimate=False)


@pytest.fixture(scope="module")
def pp_trial():
    return run_trial("tiny-llama", {"nproc": 2, "pp": 2, "batch_size": 4}, hardware="cpu", budget=QUICK)


def test_a_tensor_parallel_trial_reports_every_rank_and_its_collectives(tp_trial):
    r = tp_trial
    assert r.status == TrialStatus.ok, r.error
    assert r.hardware == "cpu:2" and r.samples_per_s > 0
    assert [(f.rank, f.coords["tp"]) for f in r.ranks] == [(0, 0), (1, 1)]
    assert all(f.coords["pp"] == f.coords["dp"] == f.coords["cp"] == 0 for f in r.ranks)
    assert all(f.peak.cpu_rss_bytes > 0 for f in r.ranks)
    # sequence parallel: activations gathered before each column-wise region, reduce-scattered after the row-wise
    first, second = (f.comm_bytes for f in r.ranks)
    assert {"all_gather", "reduce_scatter"} <= first.keys() and all(v > 0 for v in first.values())
    assert first == second  # the two halves of one replica move the same bytes
    assert r.rank_digests == []  # tp ranks hold different shards: no digest to agree on
    assert all(f.predicted_total_bytes is None and f.predicted_comm_bytes is None for f in r.ranks)  # no estimate


def test_the_trial_table_shows_each_rank(tp_trial, capsys):
    from advisor.render import trial_table

    trial_table(tp_trial)
    out = capsys.readouterr().out
    assert "per rank" in out and "0/0/0/1" in out and "reduce_scatter" in out


def test_a_pipeline_trial_sends_and_receives_between_stages_beside_its_estimate(pp_trial):
    r = pp_trial
    assert r.status == TrialStatus.ok, r.error
    assert [f.coords["pp"] for f in r.ranks] == [0, 1]
    for f in r.ranks:
        assert {"send", "recv"} <= f.comm_bytes.keys() and f.comm_bytes["send"] > 0, f.comm_bytes
        # the per-rank estimate, made before the ranks started, sits beside each rank's figures
        assert f.predicted_total_bytes and f.predicted_allocated_bytes, r.notes
        assert f.predicted_comm_bytes.keys() == f.comm_bytes.keys()
        # every thread's live tensor bytes (gloo frees on its own threads), as the per-rank estimate predicts them
        assert f.peak.cpu_allocated_bytes == pytest.approx(f.predicted_allocated_bytes, rel=0.03), r.notes
    assert r.predicted_memory_bytes is None  # the single-device estimate does not describe a pipeline rank


def test_the_store_keeps_every_rank(pp_trial, sqlite_url):
    from advisor.hardware import get_hardware
    from advisor.store import Objective, StudySpec, hardware_fingerprint, open_store, software_versions

    hw = get_hardware("cpu")
    study = StudySpec(name="pp", workload_fp="c3" * 32, workload_name="tiny-llama",
                      hardware_fp=hardware_fingerprint(hw), hardware_name="cpu",
                      hardware_spec=hw.model_dump(mode="json"), space={},
                      objective=Objective.parse("samples_per_s:maximize"), software=software_versions())
    with open_store(sqlite_url) as store:
        claim = store.claim_trial(store.create_or_get_study(study).id, pp_trial.config)
        stored = store.get_trial(store.finish_trial(claim, pp_trial).id)
    assert stored.result.ranks == pp_trial.ranks and stored.result.config.pp == 2


def test_a_context_parallel_trial_passes_keys_and_values_around_the_ring_as_estimated():
    r = run_trial("tiny-llama", {"nproc": 2, "cp": 2, "strategy": "zero3", "batch_size": 4}, hardware="cpu",
                  budget=QUICK)
    assert r.status == TrialStatus.ok, r.error
    assert [f.coords["cp"] for f in r.ranks] == [0, 1]
    for f in r.ranks:
        # the ring's rotations (all-to-all) and ZeRO-3 over the two cp ranks, which hold the same parameters
        assert {"all_to_all", "all_gather", "reduce_scatter"} <= f.comm_bytes.keys()
        assert f.comm_bytes == f.predicted_comm_bytes
        assert f.predicted_total_bytes > 0


def test_ddp_replicas_of_a_pipeline_all_reduce_their_stages_gradients_once_a_step():
    r = run_trial("tiny-llama", {"nproc": 4, "pp": 2, "strategy": "ddp", "batch_size": 4, "grad_accum": 2},
                  hardware="cpu", budget=QUICK)
    assert r.status == TrialStatus.ok, r.error
    for f in r.ranks:
        # every gradient of the rank's stage all-reduced once per optimizer step, not once per accumulated batch
        assert f.comm_bytes["all_reduce"] == f.predicted_comm_bytes["all_reduce"] > 0


@pytest.mark.parametrize("knobs", [{"pp": 2}, {"cp": 2}])
def test_zero1_replicas_of_a_pipeline_or_a_ring_all_reduce_then_broadcast_their_optimizer_shares(knobs):
    r = run_trial("tiny-llama", {"nproc": 4, **knobs, "strategy": "zero1", "batch_size": 4}, hardware="cpu",
                  budget=QUICK)
    assert r.status == TrialStatus.ok, r.error
    for f in r.ranks:
        assert f.comm_bytes == f.predicted_comm_bytes
        # DDP all-reduces every gradient; ZeroRedundancyOptimizer broadcasts every parameter from its owner
        assert f.comm_bytes["broadcast"] == f.comm_bytes["all_reduce"] > 0


def test_an_hsdp_trial_shards_within_groups_and_all_reduces_across_them():
    r = run_trial("tiny-llama", {"nproc": 4, "dp_replicate": 2, "strategy": "zero3", "batch_size": 2}, hardware="cpu",
                  budget=QUICK)
    assert r.status == TrialStatus.ok, r.error
    assert [(f.coords["dp_replicate"], f.coords["dp_shard"]) for f in r.ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for f in r.ranks:
        assert f.comm_bytes == f.predicted_comm_bytes
        # each reduce-scattered gradient shard (half of the gradients) all-reduced across the two groups
        assert f.comm_bytes["all_reduce"] * 2 == f.comm_bytes["reduce_scatter"]


# two warm-up steps: the collectives counted are the second step's, after the pipeline settled its shapes
ACCUMULATE = QUICK.model_copy(update={"warmup_steps": 2})


@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}])
def test_a_tp_or_pp_trial_accumulates_batches_and_its_estimate_counts_their_collectives(layout, tp_trial, pp_trial):
    r = run_trial("tiny-llama", {"nproc": 2, "batch_size": 4, "grad_accum": 2, **layout}, hardware="cpu",
                  budget=ACCUMULATE)
    assert r.status == TrialStatus.ok, r.error
    assert r.samples_per_s > 0 and r.config.grad_accum == 2
    for f in r.ranks:
        # each rank's measured peak beside its estimate, the collectives of both batches counted as predicted
        assert f.peak.cpu_rss_bytes > 0 and f.predicted_allocated_bytes > 0 and f.predicted_total_bytes > 0
        assert f.comm_bytes == f.predicted_comm_bytes, (f.rank, f.comm_bytes, f.predicted_comm_bytes)
    # tensor and pipeline parallel's collectives run in every batch: twice those of a step of one
    one = (tp_trial.ranks[0].comm_bytes if "tp" in layout else pp_trial.ranks[0].predicted_comm_bytes)
    assert r.ranks[0].comm_bytes == {k: 2 * v for k, v in one.items()}


def test_a_zero2_trial_gathers_its_parameters_once_a_step_of_three_batches_as_estimated():
    """ZeRO-2 keeps its gathered parameters from one batch to the next: three batches gather and reduce-scatter
    as much as one; the ring's all-to-alls run in every batch."""
    def ranks(grad_accum: int):
        r = run_trial("tiny-llama", {"nproc": 2, "cp": 2, "strategy": "zero2", "batch_size": 4,
                                     "grad_accum": grad_accum}, hardware="cpu", budget=ACCUMULATE)
        assert r.status == TrialStatus.ok, r.error
        assert all(f.comm_bytes == f.predicted_comm_bytes for f in r.ranks), r.ranks
        return r.ranks[0].comm_bytes

    one, three = ranks(1), ranks(3)
    assert three["all_gather"] == one["all_gather"] > 0 and three["reduce_scatter"] == one["reduce_scatter"]
    assert three["all_to_all"] == 3 * one["all_to_all"]


def test_micro_batch_size_gives_the_micro_batches_or_is_refused_in_one_line():
    assert TrainingConfig(nproc=2, pp=2, batch_size=8, micro_batch_size=2).layout().n_microbatches == 4
    assert TrainingConfig(nproc=2, pp=2, batch_size=8, micro_batch_size=2, microbatches=4).layout().n_microbatches == 4
    for knobs, says in (({"batch_size": 8, "micro_batch_size": 3}, "micro_batch_size 3 does not divide batch_size 8"),
                        ({"batch_size": 8, "micro_batch_size": 2, "microbatches": 2},
                         "microbatches 2 x micro_batch_size 2 != batch_size 8"),
                        ({"batch_size": 8, "micro_batch_size": 8}, "microbatches 1 cannot fill a pipeline of 2")):
        with pytest.raises(ValueError, match=re.escape(says)):
            TrainingConfig(nproc=2, pp=2, **knobs)
    with pytest.raises(ValueError, match=re.escape("pipeline knob(s) micro_batch_size need pp > 1")):
        TrainingConfig(micro_batch_size=2)


def test_layout_follows_the_knobs():
    c = TrainingConfig(nproc=4, tp=2, strategy="zero3")
    assert c.layout() == Layout(dp=2, tp=2, strategy="zero3")
    assert TrainingConfig(nproc=2, pp=2, microbatches=4).layout().n_microbatches == 4
    assert not TrainingConfig(nproc=2, strategy="ddp").layout().parallel
    assert TrainingConfig(nproc=2, pp=2, stage_layers=[3, 1]).layout().split(4) == (3, 1)
    assert TrainingConfig(nproc=8, cp=2, tp=2, strategy="zero3").layout() == Layout(dp=2, cp=2, tp=2, strategy="zero3")
    hsdp = TrainingConfig(nproc=8, dp_replicate=2, strategy="zero2").layout()
    assert (hsdp.dp, hsdp.dp_shard, hsdp.fsdp_shards, hsdp.parallel) == (8, 4, 4, True)


@pytest.mark.parametrize("knobs, says", [
    ({"nproc": 3, "tp": 2}, "nproc 3 is not a multiple of tp x pp x cp = 2"),
    ({"nproc": 2, "cp": 2}, "dp 1 x cp 2 ranks average their gradients, which needs a data-parallel strategy"),
    ({"nproc": 4, "dp_replicate": 3, "strategy": "zero3"}, "dp_replicate 3 does not divide dp 4"),
    ({"nproc": 4, "dp_replicate": 2, "strategy": "ddp"}, "use strategy zero2 or zero3, not ddp"),
    ({"nproc": 4, "tp": 2}, "dp 2 needs a data-parallel strategy"),
    ({"nproc": 2, "tp": 2, "strategy": "zero3"}, "but dp is 1"),
    ({"nproc": 2, "tp": 2, "fused_backward": True}, "fused_backward runs with tp = pp = 1 only"),
    ({"nproc": 2, "tp": 2, "compile_mode": "default"}, "use compile_mode none with tp or pp > 1"),
    ({"nproc": 2, "pp": 2, "precision": "fp16"}, "fp16 with pp is not supported"),
    ({"microbatches": 4}, "pipeline knob(s) microbatches need pp > 1"),
    ({"stage_layers": [1, 1]}, "pipeline knob(s) stage_layers need pp > 1"),
])
def test_a_layout_that_cannot_be_built_is_a_one_line_error(knobs, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        TrainingConfig(**knobs)


@pytest.mark.parametrize("knobs, says", [
    ({"nproc": 3, "tp": 3}, "tp 3 does not divide heads 4 of tiny-llama"),
    ({"nproc": 3, "pp": 3}, "3 stages, but tiny-llama has 2 layers"),
    ({"nproc": 2, "pp": 2, "batch_size": 3}, "batch 3 does not split into 2 micro-batches"),
    ({"nproc": 2, "pp": 2, "stage_layers": [2, 1]}, "stage_layers sums to 3; tiny-llama has 2 layers"),
    ({"nproc": 3, "cp": 3, "strategy": "zero2"}, "cp 3 splits seq_len 32 into 2 x cp chunks"),
])
def test_a_layout_the_model_cannot_take_is_invalid_without_launching(knobs, says):
    t0 = time.monotonic()
    r = run_trial("tiny-llama", knobs, hardware="cpu", estimate=False)
    assert r.status == TrialStatus.invalid and says in r.error, r.error
    assert r.ranks is None and time.monotonic() - t0 < 10  # refused before any rank started


@pytest.mark.parametrize("knobs, says", [
    (["nproc=3", "tp=3"], "tp may be 1, 2"),
    (["nproc=2", "pp=9"], "nproc 2 is not a multiple of tp x pp x cp = 9"),
    (["nproc=3", "tp=2"], "nproc 3 is not a multiple"),
])
def test_cli_refuses_a_bad_layout_in_one_line(knobs, says, tmp_path):
    args = [a for k in knobs for a in ("--set", k)]
    proc = subprocess.run([sys.executable, "-m", "advisor.cli", "trial", "-w", "tiny-llama", "-H", "cpu", *args,
                           "--settle", "0", "--no-estimate"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "ADVISOR_DATA_DIR": str(tmp_path)})
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and proc.stdout == "", proc.stderr

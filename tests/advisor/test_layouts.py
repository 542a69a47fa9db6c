"""Parallel layouts (advisor/parallel, advisor/estimate/parallel.py): each rank's estimate against the same rank's
program run on real gloo ranks, and the layout's checks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from advisor.errors import SpecError
from advisor.estimate import EstimateRequest
from advisor.estimate.parallel import estimate_layout
from advisor.parallel import Layout, PipelineSchedule, layout_problems
from advisor.parallel.layout import layout_over
from advisor.parallel.measure import RankMeasureRequest, measure_ranks
from advisor.workload import load_workload

# small enough for four gloo ranks on two cores; GQA (4 heads, 2 KV) and SwiGLU, as Llama
SHAPE = {"layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 256, "seq_len": 32}
BATCH = 4

LAYOUTS = [
    Layout(tp=2),
    Layout(pp=2),
    Layout(pp=2, schedule=PipelineSchedule.interleaved_1f1b, virtual_stages=2),
    Layout(dp=2, tp=2, strategy="zero3"),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.label().replace(" ", "-"))
def test_each_rank_estimate_is_what_its_real_program_allocates(layout: Layout) -> None:
    est = estimate_layout("decoder", f"cpu:{layout.world}", layout, EstimateRequest(batch_size=BATCH),
                          workload_args=SHAPE)
    # each rank's real program on real tensors, its live bytes from the profiler, alone in a process group whose
    # collectives return at once: the program's own tensor lifetimes, with none held by a slower collective
    req = RankMeasureRequest(workload="decoder", workload_args=SHAPE, layout=layout, batch_size=BATCH, mode="sync")
    alone = measure_ranks(req, timeout_s=300)
    assert len(alone) == layout.world
    for r in alone:
        e = est.for_rank(r.rank)
        assert abs(e.allocated_bytes - r.alloc_peak_bytes) <= 0.001 * r.alloc_peak_bytes, (r.rank, e, r)
    # and on real gloo ranks, every collective's bytes as counted
    real = measure_ranks(req.model_copy(update={"mode": "alloc"}), timeout_s=300)
    for r in real:
        assert est.for_rank(r.rank).comm_bytes == r.comm_bytes, (r.rank, est.for_rank(r.rank).comm_bytes, r)
    kinds = set().union(*(r.comm_bytes for r in real))
    if layout.tp > 1:  # sequence parallel: gathered before each column-wise region, reduce-scattered after
        assert {"all_gather", "reduce_scatter"} <= kinds
    if layout.pp > 1:
        assert {"send", "recv"} <= kinds


def test_pipeline_stages_differ_as_1f1b_and_gpipe_hold_micro_batches() -> None:
    def stages(schedule: PipelineSchedule) -> list:
        return estimate_layout("decoder", "cpu:2", Layout(pp=2, schedule=schedule, microbatches=4),
                               EstimateRequest(batch_size=BATCH), workload_args=SHAPE).ranks

    first, last = stages(PipelineSchedule.one_f_one_b)
    assert (first.stages, last.stages, first.layers + last.layers) == ([0], [1], SHAPE["layers"])
    logits = SHAPE["seq_len"] * SHAPE["vocab"] * 4  # one micro-batch (1 sample) of fp32 logits
    assert last.breakdown.activations >= logits
    # 1F1B: the first stage holds pp = 2 micro-batches at most; GPipe all 4 before any backward
    gpipe_first, _ = stages(PipelineSchedule.gpipe)
    assert gpipe_first.breakdown.activations > 1.3 * first.breakdown.activations


def test_tensor_parallel_shards_the_parameters() -> None:
    one = estimate_layout("decoder", "cpu:2", Layout(pp=2), EstimateRequest(batch_size=BATCH), workload_args=SHAPE)
    tp = estimate_layout("decoder", "cpu:4", Layout(pp=2, tp=2), EstimateRequest(batch_size=BATCH),
                         workload_args=SHAPE)
    for a, b in zip(one.ranks, tp.ranks):
        # everything but the norms' weights (replicated) halves
        assert 0.5 <= b.breakdown.parameters / a.breakdown.parameters < 0.52


@pytest.mark.parametrize("layout, world, problem", [
    (Layout(tp=3), 3, "tp 3 does not divide heads 4"),
    (Layout(pp=8), 8, "at most 4 stages"),
    (Layout(tp=2), 4, "product must equal the device count"),
    (Layout(pp=2, microbatches=3), 2, "does not split into 3 micro-batches"),
])
def test_layout_problems_say_what_is_wrong_and_what_is_allowed(layout: Layout, world: int, problem: str) -> None:
    wl = load_workload("decoder", SHAPE)
    found = layout_problems(layout, world=world, decoder=wl.decoder, model_name=wl.name, batch_size=BATCH)
    assert found and problem in found[0], found


def test_pipeline_needs_a_decoder_and_layouts_check_their_own_fields() -> None:
    assert "pp needs a decoder" in layout_problems(Layout(pp=2), world=2, decoder=None, model_name="tiny-mlp")[0]
    with pytest.raises(ValueError, match="needs virtual_stages >= 2"):
        Layout(pp=2, schedule=PipelineSchedule.interleaved_1f1b)
    with pytest.raises(SpecError, match="does not divide the 6 devices"):
        layout_over(6, tp=4)
    with pytest.raises(SpecError, match="needs a data-parallel strategy"):
        layout_over(4, tp=2)


def test_estimate_cli_prints_each_stage_and_refuses_bad_layouts_in_one_line() -> None:
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "advisor.cli", "estimate", "-w", "tiny-llama", *args],
                              capture_output=True, text=True, timeout=300)

    ok = run("-H", "cpu:4", "--tp", "2", "--pp", "2", "-b", "4")
    assert ok.returncode == 0, ok.stderr
    assert "stage 0" in ok.stdout and "stage 1" in ok.stdout and "send per step" in ok.stdout
    for args, says in [(["-H", "cpu:3", "--tp", "3"], "tp 3 does not divide heads 4"),
                       (["-H", "cpu:4", "--pp", "4"], "at most 2 stages"),
                       (["-H", "cpu:4", "--tp", "3"], "does not divide the 4 devices")]:
        bad = run(*args)
        lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
        assert bad.returncode == 2 and len(lines) == 1 and says in lines[0], bad.stderr

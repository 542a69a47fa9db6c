"""Parallel layouts (advisor/parallel, advisor/estimate/parallel.py): each rank's estimate against the same rank's
program run on real gloo ranks, and the layout's checks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from advisor.errors import SpecError
from advisor.estimate import EstimateRequest
from advisor.estimate.parallel import LayoutEstimate, estimate_layout
from advisor.parallel import Layout, PipelineSchedule, layout_problems
from advisor.parallel.layout import layout_over
from advisor.parallel.measure import RankMeasureRequest, measure_ranks
from advisor.workload import load_workload
from tests.advisor.gloo_ranks import run_ranks

# small enough for four gloo ranks on two cores; GQA (4 heads, 2 KV) and SwiGLU, as Llama
SHAPE = {"layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 256, "seq_len": 32}
BATCH = 4

LAYOUTS = [
    Layout(tp=2),
    Layout(pp=2),
    Layout(pp=2, schedule=PipelineSchedule.interleaved_1f1b, virtual_stages=2),
    Layout(dp=2, tp=2, strategy="zero3"),
    Layout(dp=4, dp_replicate=2, strategy="zero3"),
    Layout(cp=2, tp=2, strategy="zero2"),
    Layout(cp=2, pp=2, strategy="zero2"),
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
    if layout.cp > 1:  # the ring's rotations of keys and values
        assert "all_to_all" in kinds
    if layout.dp_replicate > 1:  # HSDP: gradient shards all-reduced across the groups
        assert "all_reduce" in kinds


def test_ring_attention_over_gloo_ranks_is_causal_attention_of_the_whole_sequence() -> None:
    from tests.advisor import ring_ranks

    errors = [float(x) for r in run_ranks(ring_ranks.errors, 2, timeout_s=120) for x in r.split()]
    assert len(errors) == 2 * 4 and max(errors) < 1e-5, errors  # out, dq, dk, dv on each of 2 ranks, fp32


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_keeps_the_logits_sharded_and_its_loss_is_the_whole_decoders(world: int) -> None:
    """On gloo ranks each tp rank's logits hold vocab / 2 of the vocabulary, and loss_parallel's loss and the gradients
    the step applies are the decoder's built whole from the same weights and batch: with and without sequence
    parallel, a tied output, checkpointing and accumulation (2 ranks); under pp, cp and FSDP2 (4 ranks)."""
    from tests.advisor import loss_parallel_ranks

    lines = [line for r in run_ranks(loss_parallel_ranks.compare, world) for line in r.splitlines()]
    rows = [line.split() for line in lines]
    assert len(rows) == world * (5 if world == 2 else 3), lines
    for name, width, error, drift in rows:
        assert int(width) in (-1, SHAPE["vocab"] // 2) and float(error) < 1e-5 and float(drift) < 1e-5, name
    assert sum(int(width) > 0 for _, width, _, _ in rows) >= world  # sharded logits seen on every rank
    assert sum(float(error) >= 0 for _, _, error, _ in rows) >= world  # losses compared on every rank


def test_under_sequence_parallel_a_block_holds_its_shard_and_backward_gathers_it_again(monkeypatch) -> None:
    """Megatron-LM's sequence parallel: the attention's and the FFN's inputs, gathered over the sequence, are held
    for backward as this rank's half of the tokens, and backward gathers each again; against the same program
    holding them gathered (the regather's wrapping left out)."""
    from advisor.parallel.tensor import _RegatherInBackward

    def rank():
        return estimate_layout("decoder", "cpu:2", Layout(tp=2), EstimateRequest(batch_size=BATCH),
                               workload_args=SHAPE).ranks[0]

    regathered = rank()
    monkeypatch.setattr(_RegatherInBackward, "wrap", classmethod(lambda cls, module: None))
    held = rank()
    region = BATCH * SHAPE["seq_len"] * SHAPE["hidden"] * 4  # one region's gathered input, fp32 (bytes)
    assert held.breakdown.activations - regathered.breakdown.activations == SHAPE["layers"] * 2 * region // 2
    assert regathered.comm_bytes["all_gather"] - held.comm_bytes["all_gather"] == SHAPE["layers"] * 2 * region


def test_context_parallel_splits_the_activations_and_holds_the_parameters_once_per_dp_rank() -> None:
    whole = estimate_layout("decoder", "cpu:2", Layout(dp=2, strategy="zero3"), EstimateRequest(batch_size=BATCH),
                            workload_args=SHAPE).ranks[0]
    cp = estimate_layout("decoder", "cpu:2", Layout(cp=2, strategy="zero3"), EstimateRequest(batch_size=BATCH),
                         workload_args=SHAPE).ranks[0]
    # cp's two ranks shard the parameters as two dp ranks do, and each holds half the tokens of its samples
    assert cp.breakdown.parameters == whole.breakdown.parameters
    assert cp.breakdown.optimizer_state == whole.breakdown.optimizer_state
    assert 0.4 < cp.breakdown.activations / whole.breakdown.activations < 0.6
    kv = BATCH * (SHAPE["seq_len"] // 2) * SHAPE["kv_heads"] * (SHAPE["hidden"] // SHAPE["heads"]) * 4 * 2
    # per layer: keys and values once around the ring forward and once backward, their fp32 gradients twice
    assert cp.comm_bytes["all_to_all"] == SHAPE["layers"] * (2 * kv + 2 * kv)


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


def test_a_gloo_scatter_root_holds_a_flat_copy_of_each_tensor_it_scatters() -> None:
    # an MLP is built whole on every rank and tensor parallel scatters its weights from tp 0; at tp 4 the build sets
    # the peak: the whole model, with gloo's flat copy of the 1024 x 1024 weight beside it on the root only
    from advisor.config import OptimizerKind, Precision
    from advisor.estimate.rank_trace import trace_rank
    from advisor.estimate.strategy import peak_breakdown

    mlp = load_workload("mlp", {"in_features": 512, "hidden": 1024, "layers": 4, "classes": 10})
    traced = {gloo: trace_rank(mlp, Layout(tp=4), 0, 8, precision=Precision.fp32, optimizer=OptimizerKind.adamw,
                               gloo=gloo) for gloo in (True, False)}
    root, peers = (peak_breakdown(t.curve)[0] for t in (traced[True].trace, traced[True].peer_trace))
    assert abs(root - peers - 1024 * 1024 * 4) <= 16, (root, peers)  # fp32; a scalar or two apart
    assert traced[False].peer_trace is None
    assert abs(peak_breakdown(traced[False].trace.curve)[0] - peers) <= 16


def test_a_gloo_send_holds_its_tensor_while_the_schedule_holds_its_work() -> None:
    # 1F1B keeps its last warm-up send's work (waited) until after the steady phase, and gloo's send work holds its
    # tensor as long as it lives: on the third of four stages, one micro-batch's stage output more at the peak
    from advisor.config import OptimizerKind, Precision
    from advisor.estimate.rank_trace import trace_rank
    from advisor.estimate.strategy import peak_breakdown

    shape = {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 4, "vocab": 4096, "seq_len": 128}
    layout, batch = Layout(pp=4), 8
    peaks = [peak_breakdown(trace_rank(load_workload("decoder", shape), layout, 2, batch, precision=Precision.fp32,
                                       optimizer=OptimizerKind.adamw, gloo=gloo).trace.curve)[0]
             for gloo in (True, False)]
    held = batch // layout.n_microbatches * 128 * 256 * 4  # fp32 (micro-batch, tokens, hidden)
    assert abs(peaks[0] - peaks[1] - held) <= 16, peaks  # a scalar or two apart


@pytest.mark.parametrize("layout, world, problem", [
    (Layout(tp=3), 3, "tp 3 does not divide heads 4"),
    (Layout(pp=8), 8, "at most 4 stages"),
    (Layout(tp=2), 4, "product must equal the device count"),
    (Layout(pp=2, microbatches=3), 2, "does not split into 3 micro-batches"),
    (Layout(cp=3, strategy="zero2"), 3, "choose seq_len a multiple of 6"),
    (Layout(cp=2, strategy="zero2"), 4, "dp 1 x cp 2 x tp 1 x pp 1 = 2 ranks, but there are 4 devices"),
])
def test_layout_problems_say_what_is_wrong_and_what_is_allowed(layout: Layout, world: int, problem: str) -> None:
    wl = load_workload("decoder", SHAPE)
    found = layout_problems(layout, world=world, decoder=wl.decoder, model_name=wl.name, batch_size=BATCH)
    assert found and problem in found[0], found


def test_pipeline_needs_a_decoder_and_layouts_check_their_own_fields() -> None:
    assert "pp needs a decoder" in layout_problems(Layout(pp=2), world=2, decoder=None, model_name="tiny-mlp")[0]
    assert "tiny-mlp has none that cp can split" in layout_problems(Layout(cp=2, strategy="zero2"), world=2,
                                                                    decoder=None, model_name="tiny-mlp")[0]
    with pytest.raises(ValueError, match="needs a data-parallel strategy"):
        Layout(cp=2)
    with pytest.raises(ValueError, match="use strategy zero2 or zero3, not ddp"):
        Layout(dp=4, dp_replicate=2, strategy="ddp")
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
    ring = run("-H", "cpu:2", "--cp", "2", "--strategy", "zero3", "-b", "4")
    assert ring.returncode == 0 and "cp2" in ring.stdout and "all-to-all per step" in ring.stdout, ring.stderr
    for args, says in [(["-H", "cpu:3", "--tp", "3"], "tp 3 does not divide heads 4"),
                       (["-H", "cpu:4", "--pp", "4"], "at most 2 stages"),
                       (["-H", "cpu:4", "--tp", "3"], "does not divide the 4 devices"),
                       (["-H", "cpu:3", "--cp", "3", "--strategy", "zero2"], "choose seq_len a multiple of 6"),
                       (["-H", "cpu:4", "--dp-replicate", "3", "--strategy", "zero3"], "does not divide dp 4")]:
        bad = run(*args)
        lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
        assert bad.returncode == 2 and len(lines) == 1 and says in lines[0], bad.stderr


def test_an_accumulated_step_of_several_batches_is_one_step_of_all_on_gloo_ranks() -> None:
    """dp 2 zero3 x pp 2: the pipeline's own reduce-scatter and scaling held back on the first batch, the loss
    scaled by 1/2, the update equals that of one step over both batches' micro-batches. dp 4: two steps of three
    batches each update zero2's parameters, kept gathered from batch to batch, as zero3's."""
    from tests.advisor import accumulate_ranks

    out = " ".join(run_ranks(accumulate_ranks.updates, 4, timeout_s=180)).split()
    errors, updates = (list(map(float, out[i::2])) for i in (0, 1))
    assert len(errors) == 8 and max(errors) < 1e-5, errors
    assert min(updates) > 0  # every stage learns: each later stage sends its input's gradient back


def test_estimate_cli_offloads_and_accumulates_on_a_layout() -> None:
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "advisor.cli", "estimate", "-w", "tiny-llama", "-H", "cpu:4",
                               "-b", "4", *args], capture_output=True, text=True, timeout=300)

    plain = run("--tp", "2", "--strategy", "zero3", "--json")
    assert plain.returncode == 0, plain.stderr
    offload = run("--tp", "2", "--strategy", "zero3", "--offload-optimizer", "--offload-params", "--grad-accum", "2",
                  "--json")
    assert offload.returncode == 0, offload.stderr
    before, after = (LayoutEstimate.model_validate_json(p.stdout).ranks[0] for p in (plain, offload))
    assert after.breakdown.optimizer_state == 0 and after.host_bytes > before.breakdown.optimizer_state
    assert LayoutEstimate.model_validate_json(offload.stdout).grad_accum == 2
    table = run("--tp", "2", "--strategy", "zero3", "--offload-optimizer")
    assert table.returncode == 0 and "host memory (offload)" in table.stdout, table.stderr
    for args, says in [(["--tp", "2", "--pp", "2", "--offload-params"], "offload_params needs strategy zero3"),
                       (["--grad-accum", "2"], "--grad-accum applies to a layout estimate")]:
        bad = run(*args)
        lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
        assert bad.returncode == 2 and len(lines) == 1 and says in lines[0], bad.stderr

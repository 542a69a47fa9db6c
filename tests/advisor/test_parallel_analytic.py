"""The analytic per-rank model of a decoder under dp x tp x pp (advisor/estimate/parallel_analytic.py) against the
traced rank programs it stands in for, and at the size it exists for (llama-70b)."""

from __future__ import annotations

import time

import pytest

from advisor.config import Checkpointing, OptimizerKind, Precision, Strategy
from advisor.errors import SpecError
from advisor.estimate.model import EstimateRequest
from advisor.estimate.parallel import estimate_layout
from advisor.estimate.parallel_analytic import analytic_rank
from advisor.estimate.rank_trace import trace_rank
from advisor.estimate.strategy import peak_breakdown
from advisor.parallel.layout import Layout
from advisor.presets import get_preset

# Three small decoders of the shapes the presets take: Llama (GQA, SwiGLU, RMSNorm), GPT-2 (GELU, LayerNorm, learned
# positions, biases; untied, as pp needs) and multi-head attention with a vocabulary tp does not divide evenly.
SHAPES = {
    "llama": dict(layers=4, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=512, seq_len=32),
    "gpt": dict(layers=4, hidden=64, heads=4, ffn=256, vocab=500, seq_len=32, mlp="gelu", norm="layernorm",
                positions="learned", bias=True),
    "mha": dict(layers=4, hidden=96, heads=6, kv_heads=6, ffn=192, vocab=385, seq_len=24),
}
LAYOUTS = {
    "tp2": Layout(tp=2),
    "pp2": Layout(pp=2),
    "tp2-pp2": Layout(tp=2, pp=2),
    "dp2-zero3-tp2": Layout(dp=2, tp=2, strategy=Strategy.zero3),
}
# context parallel and HSDP: collectives exact, memory within CP_TOLERANCE (the ring's transient blocks are
# counted at one moment, not op by op)
RING_LAYOUTS = {
    "cp2-zero3": Layout(cp=2, strategy=Strategy.zero3),
    "tp2-cp2-zero3": Layout(tp=2, cp=2, strategy=Strategy.zero3),
    "pp2-cp2-zero2": Layout(pp=2, cp=2, strategy=Strategy.zero2),
    "hsdp2x2-zero3": Layout(dp=4, dp_replicate=2, strategy=Strategy.zero3),
}
CP_TOLERANCE = 0.08
TOLERANCE = 0.03  # of the traced peak
BATCH = 4


def _compare(shape: str, layout: Layout, precision: Precision = Precision.fp32,
             optimizer: OptimizerKind = OptimizerKind.adamw,
             checkpointing: Checkpointing = Checkpointing.none, tolerance: float = TOLERANCE) -> tuple[int, int]:
    """(analytic, traced) peak of the last pipeline rank, after checking every rank's."""
    wl = get_preset("decoder")(**SHAPES[shape])
    for pp_rank in range(layout.pp):
        rt = trace_rank(wl, layout, pp_rank * (layout.world // layout.pp), BATCH, precision=precision,
                        optimizer=optimizer, checkpointing=checkpointing)
        traced, _ = peak_breakdown(rt.trace.curve)
        parts, comm = analytic_rank(wl.decoder, layout, pp_rank, BATCH, precision=precision, optimizer=optimizer,
                                    checkpointing=checkpointing, device_type="cpu")
        total = sum(parts.values())
        assert abs(total - traced) <= tolerance * traced, (pp_rank, total, traced, parts)
        assert comm == rt.comm_bytes, pp_rank
    return total, traced


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("shape", SHAPES)
def test_analytic_rank_matches_the_traced_peak_and_collectives(shape: str, layout: str) -> None:
    _compare(shape, LAYOUTS[layout])


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.bf16])
@pytest.mark.parametrize("layout", RING_LAYOUTS, ids=list(RING_LAYOUTS))
@pytest.mark.parametrize("shape", SHAPES)
def test_analytic_context_parallel_and_hsdp_match_the_trace(shape: str, layout: str, precision: Precision) -> None:
    _compare(shape, RING_LAYOUTS[layout], precision=precision, tolerance=CP_TOLERANCE)


def test_analytic_rank_follows_autocast_sgd_and_checkpointing() -> None:
    _compare("llama", Layout(tp=2), precision=Precision.bf16, optimizer=OptimizerKind.sgd_momentum,
             checkpointing=True)


@pytest.mark.parametrize("shape, layout, precision", [("llama", "tp2", Precision.fp32),
                                                       ("gpt", "dp2-zero3-tp2", Precision.bf16),
                                                       ("mha", "tp2-pp2", Precision.fp32)])
def test_analytic_rank_counts_selective_checkpointing(shape: str, layout: str, precision: Precision) -> None:
    """Selective recomputes SDPA in backward: each layer's logsumexp is not held."""
    analytic, traced = _compare(shape, LAYOUTS[layout], precision=precision, checkpointing=Checkpointing.selective)
    plain_analytic, plain_traced = _compare(shape, LAYOUTS[layout], precision=precision)
    # what selective frees at the peak, as counted and as traced (a 4-byte scalar may live at one peak only)
    assert plain_analytic - analytic > 0 and abs((plain_analytic - analytic) - (plain_traced - traced)) <= 4


def test_tp_ranks_keep_their_share_of_the_logits_and_all_reduce_the_losss_terms() -> None:
    """Under tp the logits stay sharded and loss_parallel computes the loss: a wider vocabulary costs a tp 2 rank well
    under what it costs one device (its log-softmax and their gradients are of vocab / 2 logits), and its only
    collectives without sequence parallel are all-reduces (nothing gathers the logits), as counted and as traced."""
    def grown(layout: Layout) -> tuple[int, int]:
        peaks = []
        for vocab in (2048, 4096):
            wl = get_preset("decoder")(**{**SHAPES["llama"], "vocab": vocab})
            rt = trace_rank(wl, layout, 0, BATCH, precision=Precision.fp32, optimizer=OptimizerKind.sgd)
            parts, comm = analytic_rank(wl.decoder, layout, 0, BATCH, precision=Precision.fp32,
                                        optimizer=OptimizerKind.sgd, device_type="cpu")
            assert comm == rt.comm_bytes and set(comm) <= {"all_reduce"}
            peaks.append((peak_breakdown(rt.trace.curve)[0], sum(parts.values())))
        return peaks[1][0] - peaks[0][0], peaks[1][1] - peaks[0][1]

    (one, one_analytic), (tp, tp_analytic) = grown(Layout()), grown(Layout(tp=2, sequence_parallel=False))
    assert tp < 0.7 * one and abs(tp_analytic - tp) <= TOLERANCE * tp and abs(one_analytic - one) <= TOLERANCE * one


def test_schedules_hold_the_micro_batches_their_order_keeps_in_flight() -> None:
    """Under 1F1B the first stage holds pp micro-batches at its peak, the last one; GPipe holds all of them."""
    arch = get_preset("decoder")(**{**SHAPES["llama"], "layers": 8}).decoder

    def activations(layout: Layout, pp_rank: int) -> int:
        return analytic_rank(arch, layout, pp_rank, 16, precision=Precision.fp32,
                             optimizer=OptimizerKind.sgd)[0]["activations"]

    one_f_one_b, gpipe = Layout(pp=4, microbatches=8), Layout(pp=4, microbatches=8, schedule="gpipe")
    assert activations(one_f_one_b, 0) > 3 * activations(one_f_one_b, 2) / 2
    assert activations(gpipe, 0) > 1.8 * activations(one_f_one_b, 0)


@pytest.mark.parametrize("layout", [Layout(pp=2, microbatches=16),
                                    Layout(pp=2, microbatches=16, schedule="interleaved-1f1b", virtual_stages=2)],
                         ids=["1f1b", "interleaved"])
def test_a_later_stage_holds_receive_buffers_only_for_the_micro_batches_in_flight(layout: Layout) -> None:
    """torch's PipelineStage keeps a receive buffer per micro-batch and stage, for activations and for gradients,
    from the first step to the last; the advisor's (pipeline.LeanStage) makes each as its receive is posted and lets
    it go after that micro-batch's backward. With 16 micro-batches the last stage's traced peak is the analytic
    one, which holds no buffer across the step; torch's would add over 15% to it."""
    wl = get_preset("decoder")(**{**SHAPES["llama"], "seq_len": 256})
    rt = trace_rank(wl, layout, 1, 32, precision=Precision.fp32, optimizer=OptimizerKind.adamw)
    traced, _ = peak_breakdown(rt.trace.curve)
    parts, _ = analytic_rank(wl.decoder, layout, 1, 32, precision=Precision.fp32, optimizer=OptimizerKind.adamw,
                             device_type="cpu")
    assert abs(sum(parts.values()) - traced) <= TOLERANCE * traced, (sum(parts.values()), traced, parts)
    hidden = 2 * 256 * 64 * 4  # one micro-batch's hidden states (2 samples, fp32)
    assert 16 * layout.virtual_stages * hidden > 0.15 * traced


def test_llama_70b_layout_is_estimated_in_well_under_a_second_and_fits_sensibly() -> None:
    arch = get_preset("llama-70b")().decoder
    layout = Layout(tp=8, pp=4, dp=2, strategy=Strategy.zero3)
    t0 = time.perf_counter()
    peaks = [sum(analytic_rank(arch, layout, r, 8, precision=Precision.bf16, optimizer=OptimizerKind.adamw)[0].values())
             for r in range(layout.pp)]
    assert time.perf_counter() - t0 < 1.0
    assert 20 * 2**30 < min(peaks) and max(peaks) < 80 * 2**30  # 2.2B parameters a rank, sharded by dp 2

    def estimate(batch: int, checkpointing: bool):
        return estimate_layout("llama-70b", "h100-sxm:64", layout, EstimateRequest(
            batch_size=batch, precision=Precision.bf16, checkpointing=checkpointing))

    small, large = estimate(8, True), estimate(64, False)
    assert small.method == large.method == "analytic"  # auto: 2.2B parameters a rank is past the trace's limit
    assert small.fits and not large.fits
    assert small.peak.total_bytes > small.peak.allocated_bytes  # the CUDA allocator's share is counted


def test_zero1_under_a_pipeline_shards_only_the_optimizer_state_and_counts_nccl_on_gpus() -> None:
    """zero1 is DDP (its buckets copy every gradient) with ZeroRedundancyOptimizer: each dp rank steps the greedy
    share of the stage's parameters; on GPUs each rank adds NCCL's buffers for its groups and pipeline peers."""
    from advisor.estimate.nccl import layout_bytes
    from advisor.estimate.parallel_moments import zero_partition
    from advisor.hardware import get_hardware

    def estimate(strategy: str):
        return estimate_layout("llama-8b", "h100-sxm:8", Layout(pp=2, dp=4, strategy=strategy, microbatches=4),
                               EstimateRequest(batch_size=4, precision=Precision.bf16))

    ddp, zero1 = estimate("ddp"), estimate("zero1")
    assert zero1.method == ddp.method == "analytic"
    for a, b in zip(ddp.ranks, zero1.ranks):
        assert b.breakdown.gradients == a.breakdown.gradients > 0
        assert b.breakdown.parameters == a.breakdown.parameters
        # a quarter of the state, give or take the greedy partition's imbalance of whole tensors
        assert 0.25 <= b.breakdown.optimizer_state / a.breakdown.optimizer_state < 0.3
        assert b.nccl_bytes == layout_bytes(get_hardware("h100-sxm:8"), zero1.layout, b.stages[0]) > 0
    # 4 to one rank, 3 and 2 to the other, the last 2 back to the first: the fuller holds 4 + 2
    assert zero_partition([(4, 1), (3, 1), (2, 1), (2, 1)], 2) == [(4, 1), (2, 1)]


def test_analytic_method_needs_a_decoder_and_auto_traces_small_ones() -> None:
    with pytest.raises(SpecError, match="decoder"):
        estimate_layout("tiny-mlp", "cpu:2", Layout(tp=2), EstimateRequest(batch_size=2), method="analytic")
    est = estimate_layout("tiny-llama", "cpu:2", Layout(tp=2), EstimateRequest(batch_size=2))
    assert est.method == "traced"


@pytest.mark.parametrize("layout", ["tp2", "tp2-pp2", "dp2-zero3-tp2"])
def test_offload_takes_the_optimizer_off_every_rank_traced_and_analytic_alike(layout: str) -> None:
    """ZeRO-Offload: each rank's device peak drops by at least the optimizer state it held; what the host keeps
    (state, parameter and gradient shards) is the same by both methods; offload_params also takes the shards."""
    lay, wl = LAYOUTS[layout], get_preset("decoder")(**SHAPES["llama"])
    hw = f"cpu:{lay.world}"
    base = estimate_layout(wl, hw, lay, EstimateRequest(batch_size=BATCH), method="traced")
    offloads = [{"offload_optimizer": True}]
    if lay.strategy == Strategy.zero3:
        offloads.append({"offload_params": True, "strategy": Strategy.zero3})
    lowest = {}
    for knobs in offloads:
        req = EstimateRequest(batch_size=BATCH, **knobs)
        traced = estimate_layout(wl, hw, lay, req, method="traced")
        analytic = estimate_layout(wl, hw, lay, req, method="analytic")
        for before, t, a in zip(base.ranks, traced.ranks, analytic.ranks):
            assert abs(a.allocated_bytes - t.allocated_bytes) <= TOLERANCE * t.allocated_bytes, (knobs, t, a)
            assert t.allocated_bytes <= before.allocated_bytes - before.breakdown.optimizer_state
            assert t.breakdown.optimizer_state == a.breakdown.optimizer_state == 0
            assert t.host_bytes == a.host_bytes > before.breakdown.optimizer_state and before.host_bytes == 0
            lowest.setdefault(t.stages[0], []).append(t.allocated_bytes)
    assert all(peaks == sorted(peaks, reverse=True) for peaks in lowest.values())  # the shards leave too


def test_offload_on_a_gpu_leaves_the_allocator_replay_the_smaller_peak() -> None:
    wl = get_preset("decoder")(layers=2, hidden=256, heads=4, kv_heads=2, ffn=256, vocab=4096, seq_len=32)
    lay = LAYOUTS["tp2"]

    def estimate(**knobs):
        return estimate_layout(wl, "h100-sxm:2", lay, EstimateRequest(batch_size=BATCH, **knobs), method="traced")

    base, off = estimate(), estimate(offload_optimizer=True)
    state = base.ranks[0].breakdown.optimizer_state
    assert state > 2**20 and off.ranks[0].total_bytes <= base.ranks[0].total_bytes - state  # reserved, replayed
    assert "offload" in " ".join(off.notes)


def test_offload_params_needs_the_layout_to_shard_the_parameters() -> None:
    req = EstimateRequest(batch_size=BATCH, strategy=Strategy.zero3, offload_params=True)
    with pytest.raises(SpecError, match="offload_params needs strategy zero3 .* this layout is dp1 tp2"):
        estimate_layout("tiny-llama", "cpu:2", Layout(tp=2), req)


# accumulation's layouts: ZeRO-2 keeps its gathered parameters from batch to batch, ZeRO-3 gathers them every batch
ACCUMULATED = {name: LAYOUTS[name] for name in ("tp2", "pp2", "dp2-zero3-tp2")} | {
    "dp2-zero2-tp2": Layout(dp=2, tp=2, strategy=Strategy.zero2)}


@pytest.mark.parametrize("layout", list(ACCUMULATED))
def test_accumulation_holds_the_gradients_and_runs_the_collectives_of_every_batch(layout: str) -> None:
    """grad_accum 2: the peak is the last batch's, every gradient already held; tensor and pipeline parallel
    collectives run per batch, the data-parallel reduction once a step (ZeRO-2's gathers too); traced and analytic
    agree."""
    lay, wl = ACCUMULATED[layout], get_preset("decoder")(**SHAPES["llama"])
    rises = []
    for pp_rank in range(lay.pp):
        traced = {k: trace_rank(wl, lay, pp_rank * (lay.world // lay.pp), BATCH, precision=Precision.fp32,
                                optimizer=OptimizerKind.adamw, grad_accum=k) for k in (1, 2)}
        peak = {k: peak_breakdown(rt.trace.curve)[0] for k, rt in traced.items()}
        parts, comm = analytic_rank(wl.decoder, lay, pp_rank, BATCH, precision=Precision.fp32,
                                    optimizer=OptimizerKind.adamw, device_type="cpu", grad_accum=2)
        assert abs(sum(parts.values()) - peak[2]) <= TOLERANCE * peak[2], (pp_rank, parts, peak)
        assert comm == traced[2].comm_bytes
        assert parts["gradients"] > 0 and peak[2] >= peak[1]  # the first batch's gradients, held
        rises.append(peak[2] > peak[1])
        one, two = traced[1].comm_bytes, traced[2].comm_bytes
        if lay.dp == 1:
            assert two == {kind: 2 * nbytes for kind, nbytes in one.items()}
        else:  # FSDP reduce-scatters once: less than twice
            assert one["reduce_scatter"] < two["reduce_scatter"] < 2 * one["reduce_scatter"]
            if lay.strategy == Strategy.zero2:  # gathers its units once a step (tp's sequence gathers run per batch)
                assert one["all_gather"] < two["all_gather"] < 2 * one["all_gather"]
            else:  # ZeRO-3 gathers every batch's units
                assert two["all_gather"] == 2 * one["all_gather"]
    assert rises[0]  # the first stage peaks in backward, where the held gradients add to what it holds

"""The analytic per-rank model of a decoder under dp x tp x pp (advisor/estimate/parallel_analytic.py) against the
traced rank programs it stands in for, and at the size it exists for (llama-70b)."""

from __future__ import annotations

import time

import pytest

from advisor.config import OptimizerKind, Precision, Strategy
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
TOLERANCE = 0.03  # of the traced peak
BATCH = 4


def _compare(shape: str, layout: Layout, precision: Precision = Precision.fp32,
             optimizer: OptimizerKind = OptimizerKind.adamw, checkpointing: bool = False) -> None:
    wl = get_preset("decoder")(**SHAPES[shape])
    for pp_rank in range(layout.pp):
        rt = trace_rank(wl, layout, pp_rank * layout.dp * layout.tp, BATCH, precision=precision,
                        optimizer=optimizer, checkpointing=checkpointing)
        traced, _ = peak_breakdown(rt.trace.curve)
        parts, comm = analytic_rank(wl.decoder, layout, pp_rank, BATCH, precision=precision, optimizer=optimizer,
                                    checkpointing=checkpointing, device_type="cpu")
        total = sum(parts.values())
        assert abs(total - traced) <= TOLERANCE * traced, (pp_rank, total, traced, parts)
        assert comm == rt.comm_bytes, pp_rank


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("shape", SHAPES)
def test_analytic_rank_matches_the_traced_peak_and_collectives(shape: str, layout: str) -> None:
    _compare(shape, LAYOUTS[layout])


def test_analytic_rank_follows_autocast_sgd_and_checkpointing() -> None:
    _compare("llama", Layout(tp=2), precision=Precision.bf16, optimizer=OptimizerKind.sgd_momentum,
             checkpointing=True)


def test_schedules_hold_the_micro_batches_their_order_keeps_in_flight() -> None:
    """Under 1F1B the first stage holds pp micro-batches at its peak, the last one; GPipe holds all of them."""
    arch = get_preset("decoder")(**{**SHAPES["llama"], "layers": 8}).decoder

    def activations(layout: Layout, pp_rank: int) -> int:
        return analytic_rank(arch, layout, pp_rank, 16, precision=Precision.fp32,
                             optimizer=OptimizerKind.sgd)[0]["activations"]

    one_f_one_b, gpipe = Layout(pp=4, microbatches=8), Layout(pp=4, microbatches=8, schedule="gpipe")
    assert activations(one_f_one_b, 0) > 3 * activations(one_f_one_b, 2) / 2
    assert activations(gpipe, 0) > 1.8 * activations(one_f_one_b, 0)


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


def test_analytic_method_needs_a_decoder_and_auto_traces_small_ones() -> None:
    with pytest.raises(SpecError, match="decoder"):
        estimate_layout("tiny-mlp", "cpu:2", Layout(tp=2), EstimateRequest(batch_size=2), method="analytic")
    est = estimate_layout("tiny-llama", "cpu:2", Layout(tp=2), EstimateRequest(batch_size=2))
    assert est.method == "traced"

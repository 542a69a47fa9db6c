"""The step-time model: its collective bytes are the ones a rank's program issues, its groups sit on the links
their ranks span, and its parts move the way compute, the pipeline and the links make them move."""

from __future__ import annotations

import pytest

from advisor.config import Checkpointing, OptimizerKind, Precision, Strategy
from advisor.estimate.parallel_comm import rank_comm_by_dim
from advisor.estimate.rank_trace import trace_rank
from advisor.hardware import get_hardware
from advisor.parallel.layout import Layout
from advisor.plan.collectives import COMM_EFFICIENCY, group, seconds
from advisor.plan.steptime import predict_step
from advisor.presets import get_preset
from advisor.workload import DecoderArch

SMALL = dict(layers=4, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=512, seq_len=32)
LAYOUTS = {
    "tp2": Layout(tp=2),
    "pp2": Layout(pp=2),
    "tp2-pp2-zero2": Layout(dp=2, tp=2, pp=2, strategy=Strategy.zero2),
    "dp2-zero3-tp2": Layout(dp=2, tp=2, strategy=Strategy.zero3),
    "cp2-zero3": Layout(cp=2, strategy=Strategy.zero3),
    "hsdp2x2-zero3": Layout(dp=4, dp_replicate=2, strategy=Strategy.zero3),
}
LLAMA_70B = DecoderArch(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=128256, seq_len=8192,
                        gated_ffn=True, norm="rmsnorm", bias=False)


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_collective_bytes_by_group_add_up_to_what_the_rank_program_sends(layout: str) -> None:
    """The traced rank program's collective bytes (which tests/advisor/test_layouts.py holds to real gloo ranks)
    are the sums over the groups the step-time model prices."""
    lay = LAYOUTS[layout]
    wl = get_preset("decoder")(**SMALL)
    for pp_rank in range(lay.pp):
        traced = trace_rank(wl, lay, pp_rank * (lay.world // lay.pp), 4, precision=Precision.bf16,
                            optimizer=OptimizerKind.adamw).comm_bytes
        by_dim = rank_comm_by_dim(wl.decoder, lay, pp_rank, 4, precision=Precision.bf16, device_type="cpu")
        summed: dict[str, int] = {}
        for kinds in by_dim.values():
            for kind, nbytes in kinds.items():
                summed[kind] = summed.get(kind, 0) + nbytes
        assert summed == traced, (pp_rank, by_dim, traced)
        assert set(by_dim) <= {"tp", "cp", "pp", "dp", "replicate"}
        assert ("tp" in by_dim) == (lay.tp > 1) and ("pp" in by_dim) == (lay.pp > 1)


def test_groups_take_the_links_their_ranks_span() -> None:
    hw = get_hardware("h100-sxm:8x4")
    acc = hw.accelerator
    inside = group(hw, 8, 1)  # a node's eight GPUs: NVLink
    assert not inside.crosses_nodes and inside.bandwidth == pytest.approx(acc.intra_node_gbps * 1e9 * COMM_EFFICIENCY)
    rail = group(hw, 4, 8)  # one GPU of each node: its own NIC
    assert rail.crosses_nodes and rail.bandwidth == pytest.approx(acc.inter_node_gbps * 1e9 * COMM_EFFICIENCY)
    whole = group(hw, 32, 1)  # every GPU: the rings of a node's eight NICs, bounded by its NVLink
    assert whole.bandwidth == pytest.approx(min(8 * acc.inter_node_gbps, acc.intra_node_gbps) * 1e9 * COMM_EFFICIENCY)
    assert whole.latency < rail.latency  # most of the ring's steps stay on NVLink
    big = 2**30
    assert seconds("all_reduce", big, rail) > seconds("all_reduce", big, whole) > seconds("all_reduce", big, inside)
    assert seconds("all_gather", big, inside) == pytest.approx(seconds("all_reduce", big, inside) / 2, rel=0.01)
    assert seconds("all_reduce", big, group(hw, 1, 1)) == 0.0


def _step(layout: Layout, hw: str = "h100-sxm:8x8", micro: int = 1, accum: int = 1,
          checkpointing: Checkpointing = Checkpointing.none, arch: DecoderArch = LLAMA_70B):
    return predict_step(arch, get_hardware(hw), layout, micro_batch_size=micro, grad_accum=accum,
                        precision=Precision.bf16, checkpointing=checkpointing, optimizer=OptimizerKind.adamw)


def test_the_breakdown_adds_up_and_the_bubble_is_the_schedules() -> None:
    for v, m in ((1, 4), (1, 16), (5, 20)):
        lay = Layout(dp=2, tp=8, pp=4, strategy=Strategy.zero2, microbatches=m, virtual_stages=v,
                     schedule="interleaved-1f1b" if v > 1 else "1f1b")
        st = _step(lay)
        b = st.breakdown
        assert b.compute_s + b.exposed_comm_s + b.bubble_s + b.optimizer_s == pytest.approx(st.step_time_s)
        per_micro = b.compute_s / m  # the bubble is (pp - 1) / v of a micro-batch's compute and exposed tp and pp
        assert per_micro * 3 / v <= b.bubble_s <= 1.5 * per_micro * 3 / v
        assert set(b.comm_s) == {"tp", "pp", "dp"}


def test_under_pp_an_fsdp_stage_reduces_its_gradients_after_its_last_backward() -> None:
    """torch's pipelining reduce-scatters an FSDP stage's gradients once its backwards are done: exposed, where
    without pp they run beside the last micro-batch's backward (and the gathers beside the first forward). ZeRO-2
    gathers once and reduces once, the same bytes each way."""
    piped = _step(Layout(dp=8, pp=8, strategy=Strategy.zero2, microbatches=16)).breakdown
    flat = _step(Layout(dp=64, strategy=Strategy.zero2)).breakdown
    # pipeline sends are exposed whole: what is left is data parallel's
    assert piped.exposed_comm_s - piped.comm_s["pp"] > 0.45 * piped.comm_s["dp"] > 0
    assert flat.exposed_comm_s < 0.05 * flat.comm_s["dp"]


def test_accumulated_micro_batches_give_a_steps_fsdp_reduction_no_more_cover() -> None:
    """A step's gradients exist only in its last micro-batch's backward (the others accumulate without syncing), so
    its reduce-scatter hides behind that backward alone, however many micro-batches ran before; ZeRO-2's gathers,
    made once and kept, hide behind the first forward alone. Here one micro-batch's backward cannot cover its
    re-gathers and the reduction together."""
    arch = LLAMA_70B.model_copy(update={"seq_len": 3400})
    for strategy in (Strategy.zero2, Strategy.zero3):
        one, eight = (_step(Layout(dp=64, strategy=strategy), accum=a, arch=arch).breakdown for a in (1, 8))
        assert eight.compute_s == pytest.approx(8 * one.compute_s)
        assert eight.exposed_comm_s >= one.exposed_comm_s > 0.08 * one.comm_s["dp"], strategy
        if strategy == Strategy.zero2:  # gathered once, reduced once: the same collectives, as exposed
            assert (eight.comm_s["dp"], eight.exposed_comm_s) == pytest.approx((one.comm_s["dp"], one.exposed_comm_s))


def test_recompute_accumulation_and_crossing_nodes_cost_what_they_should() -> None:
    lay = Layout(dp=8, tp=8, strategy=Strategy.zero3)
    none, full = _step(lay), _step(lay, checkpointing=Checkpointing.full)
    selective = _step(lay, checkpointing=Checkpointing.selective)
    # full recompute adds a forward to forward + backward (about a third); selective only attention's core
    assert 1.25 < full.breakdown.compute_s / none.breakdown.compute_s < 1.36
    assert none.breakdown.compute_s < selective.breakdown.compute_s < full.breakdown.compute_s
    four = _step(lay, accum=4)
    assert four.breakdown.compute_s == pytest.approx(4 * none.breakdown.compute_s)
    assert four.flops_per_device == pytest.approx(4 * none.flops_per_device)
    # tp 8 over one node's NVLink, then over two nodes of four, each pooling its four NICs
    near = _step(Layout(tp=8), hw="h100-sxm:8")
    far = _step(Layout(tp=8), hw="h100-sxm:4x2")
    assert far.breakdown.comm_s["tp"] > 2 * near.breakdown.comm_s["tp"]  # 450 GB/s against 4 x 50
    assert far.breakdown.compute_s == near.breakdown.compute_s


def test_model_flops_match_the_six_n_d_rule_on_a_large_decoder() -> None:
    """Matrix products dominate a 70B model: its FLOPs per token are 6 x its parameters plus attention's."""
    lay = Layout(dp=8, tp=8, strategy=Strategy.zero3)
    st = _step(lay, micro=2)
    tokens = 2 * LLAMA_70B.seq_len
    params = 70.55e9 - LLAMA_70B.vocab * LLAMA_70B.hidden  # the input embedding is a lookup, not a product
    attention = 3 * 4 * LLAMA_70B.layers * LLAMA_70B.hidden * LLAMA_70B.seq_len / 2  # causal, per token
    expected = tokens * (6 * params + attention) / 8
    assert st.flops_per_device == pytest.approx(expected, rel=0.02)


def test_a_precision_the_device_has_no_peak_for_is_refused() -> None:
    with pytest.raises(ValueError, match="fp16"):
        predict_step(LLAMA_70B, get_hardware("cpu"), Layout(), micro_batch_size=1, grad_accum=1,
                     precision=Precision.fp16, checkpointing=Checkpointing.none, optimizer=OptimizerKind.adamw)

"""Collective payload bytes of one pipeline rank of a decoder per optimizer step, by the mesh dimension whose
process group carries them and by kind (advisor/parallel/comm.py's kinds): what the step-time model prices on
each group's links, and, summed over dimensions, what parallel_analytic.py reports (the tests hold both to
real ranks)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from advisor.config import Checkpointing, Precision, Strategy
from advisor.estimate.parallel_moments import F32
from advisor.parallel.layout import Layout
from advisor.workload import DecoderArch

if TYPE_CHECKING:
    from advisor.estimate.parallel_moments import RankDims, StageFigures

DIMS = ("tp", "cp", "pp", "dp", "replicate")  # "replicate": HSDP's all-reduce across the replica groups


def rank_comm_by_dim(arch: DecoderArch, layout: Layout, pp_rank: int, batch_size: int, *, precision: Precision,
                     checkpointing: Checkpointing = Checkpointing.none, grad_accum: int = 1,
                     device_type: str = "cuda") -> dict[str, dict[str, int]]:
    """`comm_by_dim` of pipeline rank `pp_rank`, its arguments as parallel_analytic.analytic_rank takes them."""
    from advisor.estimate.parallel_analytic import _dims, _stage, _stage_indices

    checkpointing = Checkpointing(checkpointing)
    micro = batch_size // layout.n_microbatches if layout.pp > 1 else batch_size
    d = _dims(arch, layout, micro, precision, device_type == "cpu", checkpointing=checkpointing)
    stages = [_stage(arch, layout, d, s, checkpointing) for s in _stage_indices(layout, pp_rank)]
    return comm_by_dim(arch, layout, d, stages, pp_rank, checkpointing, grad_accum)


def comm_by_dim(arch: DecoderArch, layout: Layout, d: RankDims, stages: list[StageFigures], pp_rank: int,
                checkpointing: Checkpointing, grad_accum: int = 1) -> dict[str, dict[str, int]]:
    """Payload bytes per optimizer step, {dim: {kind: bytes}}: tensor parallel's per layer, forward and backward,
    for every micro-batch of each of the step's `grad_accum` batches; pipeline sends and receives of hidden states
    and their gradients; the context-parallel ring; the data-parallel strategy's reductions once per step (ZeRO:
    gathers per FSDP unit, each time the schedule finds it sharded, in every batch)."""
    from advisor.estimate.parallel_analytic import _tensor_comm

    out: dict[str, Counter[str]] = {dim: Counter() for dim in DIMS}
    n = (layout.n_microbatches if d.pp else 1) * grad_accum
    hidden = d.b * d.s * arch.hidden * d.r
    for st in stages:
        if d.t > 1:
            for kind, nbytes in _tensor_comm(arch, d, st, checkpointing).items():
                out["tp"][kind] += n * nbytes
        if d.pp:
            out["pp"]["send"] += n * hidden * ((not st.first) + (not st.last))
            out["pp"]["recv"] += n * hidden * ((not st.first) + (not st.last))
    if layout.cp > 1:  # the ring (context.py), per layer: keys and values around it, their fp32 gradients back
        kv = d.b * d.T * arch.kv_heads * (arch.hidden // arch.heads) // d.t * 2
        ring = 2 * (layout.cp - 1) * kv * d.c + layout.cp * kv * F32
        out["cp"]["all_to_all"] += n * sum(st.layers for st in stages) * ring
    if layout.grad_ranks > 1:
        _data_comm(out, arch, layout, d, stages, pp_rank, grad_accum)
    return {dim: {k: v for k, v in sorted(kinds.items()) if v} for dim, kinds in out.items() if any(kinds.values())}


def _data_comm(out: dict[str, Counter[str]], arch: DecoderArch, layout: Layout, d: RankDims,
               stages: list[StageFigures], pp_rank: int, grad_accum: int = 1) -> None:
    """DDP all-reduces every gradient once a step (and ZeRO-1 then broadcasts the updated parameters). FSDP2
    gathers a unit (its padded shards) each time a forward or backward of any of the step's `grad_accum` batches
    finds it sharded (ZeRO-2 keeps it gathered from one batch to the next), reduce-scatters its padded gradients
    once a step, and all-reduces over tp the gradients of the parameters tp replicates (norms)."""
    from advisor.estimate.parallel_analytic import _gathers, _norm_shapes, gathering_batches

    units = [[sum(a * b for a, b in u) * d.r for u in st.units] for st in stages]
    if layout.strategy in (Strategy.ddp, Strategy.zero1):
        out["dp"]["all_reduce"] += sum(map(sum, units))
        if layout.strategy == Strategy.zero1:  # ZeroRedundancyOptimizer: each partition broadcast by its owner
            out["dp"]["broadcast"] += sum(map(sum, units))
        return
    dp = layout.fsdp_shards
    padded = [sum(sum(-(-a // dp) * dp * b for a, b in u) for u in st.units) * d.r for st in stages]
    gathers = _gathers(layout, pp_rank, len(stages))
    out["dp"]["all_gather"] += gathering_batches(layout, grad_accum) * sum(g * p for g, p in zip(gathers, padded))
    out["dp"]["reduce_scatter"] += sum(padded)
    if layout.dp_replicate > 1:  # HSDP: each reduce-scattered shard all-reduced across the replica groups
        out["replicate"]["all_reduce"] += sum(padded) // dp
    if d.t > 1:
        norms = sum(a for a, _ in _norm_shapes(arch))
        out["tp"]["all_reduce"] += sum(2 * st.layers + st.last for st in stages) * norms * d.r

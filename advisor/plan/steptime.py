"""Step time of a decoder under a parallel layout on given hardware: compute, the communication that compute
does not hide, the pipeline's bubble and the optimizer step, for the slowest rank (docs/planner.md says what
overlaps what).

Per micro-batch, each pipeline rank runs its layers' forward and backward (compute.py), recomputing what
checkpointing dropped; tensor-parallel collectives sit on the critical path (the program runs DTensor's
synchronous redistributions), the context-parallel ring hides behind attention, and pipeline sends are exposed.
A step runs m micro-batches through pp ranks, plus the (pp - 1) / v micro-batch times of the 1F1B bubble
(Narayanan et al. 2021, sec. 2.2). Data-parallel reductions and FSDP gathers run beside compute on their own
stream; what exceeds the compute they overlap, and the first gather and last reduction, are exposed.
Collective payloads are those advisor/estimate/parallel_analytic.py counts, which the tests check against real
ranks.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from advisor.config import Checkpointing, OptimizerKind, Precision, Strategy
from advisor.estimate.parallel_tuned import Tuning
from advisor.hardware.spec import HardwareSpec
from advisor.parallel.layout import Layout
from advisor.plan.collectives import Group, group, seconds
from advisor.plan.compute import DeviceRates, head_s, layer_work
from advisor.workload import DecoderArch

# Share of the datasheet's dense peak that large bf16/fp16 matrix products sustain inside a training step, and
# that fused attention kernels sustain; share of the memory bandwidth that elementwise kernels reach; fixed
# seconds per kernel. Fitted on half of ../shared/published_perf's dense BF16 H100 rows, checked on the rest:
# bench/plan_accuracy.py, bench/results/plan-accuracy.json
MATMUL_EFFICIENCY = 0.78
ATTENTION_EFFICIENCY = 0.25
BANDWIDTH_EFFICIENCY = 0.80
LAUNCH_S = 5e-6

# ZeRO-Offload's optimizer step on the host: gradients down and parameters up over PCIe (Gen4 x16, 32 GB/s each
# way, the slowest host link of the catalog's GPUs), and the step at a host memory bandwidth a two-socket server's
# optimizer reaches (assumed: a quarter of its ~400 GB/s STREAM figure)
HOST_LINK_BYTES_PER_S = 32e9 * 0.8
HOST_STEP_BYTES_PER_S = 100e9

# DDP's gradient buckets (torch's default bucket_cap_mb): the last bucket's all-reduce follows the last backward
DDP_BUCKET_BYTES = 25 * 2**20


class StepBreakdown(BaseModel):
    """Seconds of one optimizer step on the slowest rank, by where they go; they add up to the step time."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    compute_s: float = Field(description="Forward, backward and recompute of every micro-batch (s).")
    exposed_comm_s: float = Field(description="Communication compute does not hide: tensor-parallel collectives, "
                                  "pipeline sends, the ring's excess over attention, the data-parallel tail (s).")
    bubble_s: float = Field(description="The pipeline's fill and drain, (pp - 1) / v micro-batch times (s).")
    optimizer_s: float = Field(description="The optimizer step over this rank's parameters or shard (s).")
    comm_s: dict[str, float] = Field(description="Transfer time by mesh dimension ('tp', 'cp', 'pp', 'dp') "
                                     "before overlap (s).")


class StepTime(BaseModel):
    """The predicted time of one optimizer step and what it is made of."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step_time_s: float = Field(description="Seconds per optimizer step.")
    breakdown: StepBreakdown
    flops_per_device: float = Field(description="Model FLOPs per device per step (matrix products and attention, "
                                    "forward and backward, recompute excluded).")


def predict_step(arch: DecoderArch, hw: HardwareSpec, layout: Layout, *, micro_batch_size: int, grad_accum: int,
                 precision: Precision, checkpointing: Checkpointing, optimizer: OptimizerKind,
                 offload_optimizer: bool = False, tuning: Tuning | None = None) -> StepTime:
    """One optimizer step of `arch` under `layout` on `hw`: each data-parallel replica runs `micro_batch_size`
    samples per micro-batch, layout.n_microbatches of them through the pipeline under pp, each `grad_accum`
    times, else `grad_accum` accumulated micro-batches. The slowest pipeline rank's time. `tuning`: a fine-tune
    (frozen weights get no weight gradient and no reduction, blocks no gradient reaches run no backward, the
    optimizer steps the trained parameters). Raises ValueError where the hardware has no peak for the precision."""
    checkpointing = Checkpointing(checkpointing)
    rates = device_rates(hw, precision)
    groups = mesh_groups(hw, layout)
    ranks = [_rank_step(arch, hw, layout, p, rates, groups, micro_batch_size, grad_accum, precision, checkpointing,
                        optimizer, offload_optimizer, tuning) for p in range(layout.pp)]
    return max(ranks, key=lambda r: r.step_time_s)


def device_rates(hw: HardwareSpec, precision: Precision) -> DeviceRates:
    """The sustained rates of one of `hw`'s devices for `precision`'s matrix products."""
    from advisor.estimate.roofline import peak_flops

    peak = peak_flops(hw, precision)
    return DeviceRates(matmul_flops=peak * MATMUL_EFFICIENCY, attention_flops=peak * ATTENTION_EFFICIENCY,
                       bandwidth=hw.accelerator.memory_bandwidth_gbps * 1e9 * BANDWIDTH_EFFICIENCY,
                       launch_s=LAUNCH_S)


def mesh_groups(hw: HardwareSpec, layout: Layout) -> dict[str, Group]:
    """The process groups of the layout's mesh (advisor/parallel/program.py's, ranks ordered pp, dp, cp, tp with tp
    innermost), by parallel_comm.DIMS: tp; cp; "dp" the ranks that average gradients (dp x cp), FSDP's shard
    group under HSDP; "replicate" HSDP's groups; "pp" the pipeline, whose sends go rank to rank."""
    t, c = layout.tp, layout.cp
    shard = layout.dp_shard * c if layout.dp_replicate > 1 else layout.grad_ranks
    return {"tp": group(hw, t, 1), "cp": group(hw, c, t), "dp": group(hw, shard, t),
            "replicate": group(hw, layout.dp_replicate, t * c * layout.dp_shard),
            "pp": group(hw, layout.pp, t * c * layout.dp, rings=False)}


def _rank_step(arch: DecoderArch, hw: HardwareSpec, layout: Layout, pp_rank: int, rates: DeviceRates,
               groups: dict[str, Group], micro: int, grad_accum: int, precision: Precision,
               checkpointing: Checkpointing, optimizer: OptimizerKind, offload: bool,
               tuning: Tuning | None = None) -> StepTime:
    """Pipeline rank `pp_rank`'s step."""
    from advisor.estimate.parallel_analytic import _dims, _stage, _stage_indices, layout_comm, regather_bytes

    d = _dims(arch, layout, micro, precision, hw.device_type == "cpu", tuning, checkpointing)
    indices = _stage_indices(layout, pp_rank)
    stages = [_stage(arch, layout, d, s, checkpointing, tuning) for s in indices]
    m = (layout.n_microbatches if layout.pp > 1 else 1) * grad_accum
    if tuning is None:
        fwd, bwd, attention, flops = _micro_batch(arch, layout, stages, rates, d, micro, checkpointing)
    else:
        fwd, bwd, attention, flops = _tuned_micro_batch(arch, layout, indices, rates, d, micro, checkpointing,
                                                        tuning)
    comm = layout_comm(arch, layout, d, stages, pp_rank, checkpointing, grad_accum)
    layers = sum(st.layers for st in stages)
    # 2 gathers, 2 reductions a layer, each way; the last stage's loss adds three small all-reduces
    last = any(st.last for st in stages)
    tp_kinds = dict(comm.get("tp", {}))
    # backward's second gather of each region's input (sequence parallel's regather), overlapped with the input
    # gradients' products as Megatron-LM runs it
    again = m * regather_bytes(arch, d, layers)
    if again:
        tp_kinds["all_gather"] -= again
    tp = _priced(tp_kinds, groups["tp"], m * (8 * layers + 2 + 3 * last))
    regather = seconds("all_gather", again, groups["tp"], m * 2 * layers) if again else 0.0
    cp = _priced(comm.get("cp", {}), groups["cp"], m * layers * 3 * (layout.cp - 1))  # k, v and their gradients
    sends = {"send": comm.get("pp", {}).get("send", 0)}  # a send and its matching receive share the link
    pp = _priced(sends, groups["pp"], m * sum((not st.first) + (not st.last) for st in stages))
    # the regather hides behind half the backward, the ring behind attention: what outlasts them is exposed
    exposed = tp + max(regather - m * bwd / 2, 0.0) + max(cp - m * layers * 3.5 * attention, 0.0) + pp
    tp += regather
    compute = m * (fwd + bwd)
    # 1F1B's fill and drain: (pp - 1) / v micro-batch times of the rank, each of the grad_accum schedules
    bubble = (layout.pp - 1) / layout.virtual_stages * (compute + exposed) / m * grad_accum if layout.pp > 1 else 0.
    dp, dp_exposed = _data_parallel(comm, layout, groups, (fwd, bwd, m), sum(len(st.units) for st in stages))
    elements = sum(sum(a * b for a, b in u) for st in stages for u in st.units)
    opt = _optimizer_s(elements, layout, optimizer, d.pw, rates, offload)
    breakdown = StepBreakdown(compute_s=compute, exposed_comm_s=exposed + dp_exposed, bubble_s=bubble,
                              optimizer_s=opt, comm_s={k: v for k, v in (("tp", tp), ("cp", cp), ("pp", pp),
                                                                         ("dp", dp)) if v})
    return StepTime(step_time_s=compute + exposed + dp_exposed + bubble + opt, breakdown=breakdown,
                    flops_per_device=m * flops)


def _micro_batch(arch: DecoderArch, layout: Layout, stages: list, rates: DeviceRates, d, micro: int,
                 checkpointing: Checkpointing) -> tuple[float, float, float, float]:
    """(forward s, backward s with recompute, one layer's attention forward s, model FLOPs) of one micro-batch
    through the rank's stages."""
    sp = d.s != d.T
    work = layer_work(arch, rates, tokens=micro * d.T, kv_tokens=arch.seq_len, tp=layout.tp, sp=sp, elt=d.c,
                      residual_elt=d.r)
    layers = sum(st.layers for st in stages)
    # a checkpointed block runs its forward again before its backward; selective, its attention core
    again = {Checkpointing.full: work.forward_s, Checkpointing.selective: work.attention_s}.get(checkpointing, 0.0)
    fwd, bwd = layers * work.forward_s, layers * (work.backward_s + again)
    flops = 3 * layers * (work.matmul_flops + work.attention_flops)  # forward, and backward at twice it
    if any(st.last for st in stages):
        head, head_flops = head_s(arch, rates, tokens=micro * d.T, tp=layout.tp, elt=d.c)
        fwd, bwd, flops = fwd + head / 3, bwd + 2 * head / 3, flops + head_flops
    return fwd, bwd, work.attention_s, flops


def _tuned_micro_batch(arch: DecoderArch, layout: Layout, indices: list[int], rates: DeviceRates, d, micro: int,
                       checkpointing: Checkpointing, tuning: Tuning) -> tuple[float, float, float, float]:
    """_micro_batch's figures for a fine-tune: each block's products with its frozen weights and adapters; a block
    no gradient reaches (nothing before it or in it trains) runs its forward only."""
    from advisor.estimate.parallel_tuned import _flows_into, layer_saved

    kw = dict(tokens=micro * d.T, kv_tokens=arch.seq_len, tp=layout.tp, sp=d.s != d.T, elt=d.c, residual_elt=d.r)
    sizes = layout.split(arch.layers)
    fwd = bwd = flops = attention = 0.0
    works: dict[tuple, object] = {}
    for index in indices:
        start = sum(sizes[:index])
        flows = _flows_into(arch, d, tuning, start)
        for layer in range(start, start + sizes[index]):
            key = (tuning.frozen[layer], tuning.layer_adapters(layer))
            if key not in works:
                works[key] = layer_work(arch, rates, frozen=key[0], adapters=key[1], r=tuning.r, **kw)
            work = works[key]
            live = flows or layer_saved(arch, d, tuning, layer, flows)[1]
            flows = live
            again = {Checkpointing.full: work.forward_s, Checkpointing.selective: work.attention_s}.get(
                checkpointing, 0.0)
            fwd, attention = fwd + work.forward_s, work.attention_s
            bwd += (work.backward_s + again) * live
            flops += work.step_flops if live else work.matmul_flops + work.attention_flops
        if index == layout.stages - 1:
            head, head_flops = head_s(arch, rates, tokens=micro * d.T, tp=layout.tp, elt=d.c,
                                      frozen="output" in tuning.frozen_root,
                                      adapter_r=tuning.r * tuning.head_adapter)
            fwd, bwd, flops = fwd + head / 3, bwd + 2 * head / 3, flops + head_flops
    return fwd, bwd, attention, flops


def _priced(kinds: dict[str, int], g: Group, calls: int) -> float:
    """Seconds of a group's collectives, `calls` of them shared among the kinds."""
    share = max(round(calls / max(len(kinds), 1)), 1)
    return sum(seconds(kind, nbytes, g, share) for kind, nbytes in kinds.items())


def _data_parallel(comm: dict[str, dict[str, int]], layout: Layout, groups: dict[str, Group],
                   micro_batch: tuple[float, float, int], units: int) -> tuple[float, float]:
    """(seconds of the step's data-parallel collectives, seconds of them exposed); `micro_batch`: (forward s,
    backward s, micro-batches a step). A step's gradients exist only in its last micro-batch's backward (the others
    accumulate without syncing: advisor/parallel/accumulate.py), so every reduction hides behind that backward
    alone. DDP reduces bucket by bucket, the last bucket after it; ZeRO-1 then broadcasts the updated parameters
    with nothing to overlap. FSDP gathers its `units` one by one ahead of the compute that needs them: ZeRO-3 in
    each micro-batch's forward and again in its backward, ZeRO-2 once, in the first forward (it keeps them
    gathered); the first unit's gather and the last one's reduction are exposed. Under pp an FSDP stage's
    reductions wait for its last backward, all exposed."""
    fwd, bwd, m = micro_batch
    kinds = comm.get("dp", {})
    if not kinds:
        return 0.0, 0.0
    if layout.strategy in (Strategy.ddp, Strategy.zero1):
        grads = kinds.get("all_reduce", 0)
        reduce = seconds("all_reduce", grads, groups["dp"], -(-grads // DDP_BUCKET_BYTES))
        exposed = max(reduce - bwd, 0.0) + reduce * min(1.0, DDP_BUCKET_BYTES / max(grads, 1))
        broadcast = seconds("broadcast", kinds.get("broadcast", 0), groups["dp"], layout.grad_ranks)
        return reduce + broadcast, exposed + broadcast
    gather = sum(seconds(kind, n, groups["dp"], units) for kind, n in kinds.items() if kind != "reduce_scatter")
    reduce = seconds("reduce_scatter", kinds.get("reduce_scatter", 0), groups["dp"], units)
    reduce += sum(seconds(kind, n, groups["replicate"], units) for kind, n in comm.get("replicate", {}).items())
    total = gather + reduce
    if layout.pp > 1:
        # torch's pipelining reduces an FSDP stage's gradients once its last backward is done (the schedule's
        # REDUCE_GRAD action, PipelineStage.perform_reduce_grad): no compute is left to hide them
        return total, max(gather - m * (fwd + bwd), 0.0) + gather / units + reduce
    if layout.strategy.keeps_gathered:  # ZeRO-2: all of the step's gathers in the first forward
        return total, max(gather - fwd, 0.0) + max(reduce - bwd, 0.0) + total / units
    # ZeRO-3: each micro-batch gathers its share, half beside its forward and half again beside its backward
    half = gather / m / 2
    exposed = m * max(half - fwd, 0.0) + (m - 1) * max(half - bwd, 0.0) + max(half + reduce - bwd, 0.0)
    return total, exposed + total / units


# parameter-sized tensors an optimizer step reads and writes per element: Adam reads the parameter, its gradient
# and two moments and writes the parameter and the moments
_ACCESSES = {OptimizerKind.adam: 7, OptimizerKind.adamw: 7, OptimizerKind.sgd: 3, OptimizerKind.sgd_momentum: 5,
             OptimizerKind.adagrad: 5, OptimizerKind.rowwise_adagrad: 4}


def _optimizer_s(elements: int, layout: Layout, optimizer: OptimizerKind, elt: int, rates: DeviceRates,
                 offload: bool) -> float:
    """Seconds of the optimizer step over the `elements` this rank holds, or its ZeRO shard of them; `elt`: bytes
    of the parameters and state."""
    if layout.strategy in (Strategy.zero1, Strategy.zero2, Strategy.zero3):
        elements = -(-elements // layout.fsdp_shards)
    traffic = elements * _ACCESSES[optimizer] * elt
    if offload:
        return 2 * elements * elt / HOST_LINK_BYTES_PER_S + traffic / HOST_STEP_BYTES_PER_S
    return rates.launch_s * 4 + traffic / rates.bandwidth

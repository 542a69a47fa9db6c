"""The moments of one pipeline rank's training step at which its memory can peak, and its live bytes by part at each:
the end of a micro-batch's forward (on the last stage, the output layer's logits and the loss), the start of its
backward, the output layer's and the stage's first blocks' backward, its end, and the optimizer step. The schedule's
order of forwards and backwards (torch.distributed.pipelining) says how many micro-batches each moment holds and
which gradients exist; FSDP2's gathers, prefetches and reduce-scatters say what is gathered. parallel_analytic.py
counts the stage figures these moments add up.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from advisor.config import Checkpointing, OptimizerKind, Strategy
from advisor.estimate.analytic import STATE_PER_PARAM
from advisor.parallel.layout import Layout, PipelineSchedule
from advisor.workload import DecoderArch

F32 = 4  # bytes: the loss's log-softmax, norms' and attention's statistics, Adam's step counters


@dataclass(frozen=True)
class RankDims:
    """One micro-batch on one rank: sizes (elements) and dtypes (bytes per element)."""

    b: int  # samples in a micro-batch
    T: int  # tokens per sample
    s: int  # tokens per sample between tp regions: T / tp under sequence parallel, else T
    t: int  # tp
    r: int  # parameters and the residual stream: 2 under pure bf16, else 4
    c: int  # matrix products' outputs: 2 under autocast or pure bf16, else 4
    autocast: bool
    pp: bool  # the stage runs under a pipeline schedule (its output waits for its backward)
    gloo: bool  # collectives run on gloo (a CPU rank), whose all-gather holds a buffer of its output's size
    ring: bool = False  # context parallel: attention is the ring (context.py), fed unexpanded keys and values
    regather: bool = False  # sequence parallel keeps each region's shard, gathered again in backward (tensor.py)
    w: int = 0  # trained parameters (fine-tune): 2 under pure bf16, else 4; 0: r
    z: int = 0  # frozen parameters (fine-tune): 2 under bf16 or pure bf16 (finetune.hold_frozen), else 4; 0: r

    @property
    def pw(self) -> int:
        """Bytes of a trained parameter."""
        return self.w or self.r

    @property
    def pf(self) -> int:
        """Bytes of a frozen parameter."""
        return self.z or self.r


@dataclass(frozen=True)
class StageFigures:
    """One pipeline stage on one tp rank: parameter shapes as (dim 0, elements per dim-0 row), bytes per
    micro-batch in flight, and what the data-parallel strategy makes of it."""

    first: bool
    last: bool
    layers: int
    units: tuple[tuple[tuple[int, int], ...], ...]  # FSDP units: each block (where >= 2), then the rest (root)
    linear: int  # elements of Linear weights and biases, which autocast casts and caches
    saved: int  # bytes kept per micro-batch in flight
    output_extra: int  # bytes beyond `saved` as the output layer's forward ends (its logits; may be negative)
    loss_extra: int  # bytes beyond `saved` while the loss is computed (after the stage's forward)
    head_bwd: int  # bytes beyond `saved` as the loss's backward starts (last stage)
    block_bwd: tuple[int, int]  # bytes beyond `saved` early in a block's backward: the stage's first, the later ones
    log_softmax: int  # bytes of the fp32 log-softmax of this rank's logits a micro-batch keeps (last stage)
    head: int  # bytes the final norm, the output layer and the loss keep per micro-batch (last stage)
    head_grad: int  # bytes of the output weight's gradient (last stage)
    embed_grad: int  # bytes of the embeddings' gradients, whole tables (first stage)
    largest: int  # bytes of the stage's largest Linear weight
    block_bytes: int  # bytes of the gradient of the stage's first block (its trained parameters)
    block_linear: int  # elements of one block's Linear weights and biases
    first_block: int  # bytes a micro-batch keeps as its backward reaches the stage's first block
    per_layer: int  # bytes a block keeps per micro-batch (its input alone when checkpointed)
    grad_extra: int  # gradient bytes beyond the local parameters': tp's embeddings get whole-table gradients
    frozen_units: tuple[tuple[tuple[int, int], ...], ...] = ()  # per unit, its frozen parameters' shapes (fine-tune)


@dataclass(frozen=True)
class StepKnobs:
    """What one optimizer step of a rank spans beyond a batch, and where ZeRO-Offload keeps its state."""

    grad_accum: int = 1  # batches whose gradients add up before the step; its peak falls on the last, gradients held
    offload_optimizer: bool = False  # the optimizer state and step on the host
    offload_params: bool = False  # zero3: the sharded parameters, and gradients once reduce-scattered, on the host


def schedule_order(layout: Layout, pp_rank: int) -> tuple[tuple[str, int], ...]:
    """This rank's forwards ("F") and backwards ("B") of micro-batches in the order its schedule runs them, each with
    the local stage it runs on (torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B)."""
    return _schedule_order(layout.n_microbatches, layout.pp, layout.schedule, layout.virtual_stages, pp_rank)


@functools.lru_cache(maxsize=4096)  # the planner asks for the same few schedules thousands of times
def _schedule_order(n: int, pp: int, schedule: PipelineSchedule, v: int, pp_rank: int) -> tuple[tuple[str, int], ...]:
    return tuple(_order(n, pp, schedule, v, pp_rank))


def _order(n: int, pp: int, schedule: PipelineSchedule, v: int, pp_rank: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("F", 0), ("B", 0)]
    if schedule == PipelineSchedule.gpipe:
        return [("F", 0)] * n + [("B", 0)] * n
    if schedule == PipelineSchedule.one_f_one_b:
        warm = min(n, pp - pp_rank)  # the last stage runs one forward ahead, the first pp
        steady = [op for _ in range(n - warm) for op in (("B", 0), ("F", 0))]
        return [("F", 0)] * warm + steady + [("B", 0)] * warm
    per_round = n // max(1, n // pp)
    warm = min((v - 1) * per_round + 2 * (pp - 1 - pp_rank), n * v)  # torch's _get_warmup_ops

    def forward_stage(op: int) -> int:
        return (op // per_round) % v

    def backward_stage(op: int) -> int:
        return v - 1 - ((op - warm) // per_round) % v

    order: list[tuple[str, int]] = []
    for op in range(n * v + warm):
        if op < n * v:
            order.append(("F", forward_stage(op)))
        if op >= warm:
            order.append(("B", backward_stage(op)))
    return order


class RankMemory:
    """One rank's live bytes, by part, at each moment its peak can fall on: the end of each micro-batch's forward
    (the output layer's logits and the loss on the last stage), the start and end of each backward, and the
    optimizer step."""

    def __init__(self, arch: DecoderArch, layout: Layout, d: RankDims, stages: list[StageFigures], pp_rank: int,
                 optimizer: OptimizerKind, impl: str | None, batch_size: int, checkpointing: Checkpointing,
                 knobs: StepKnobs = StepKnobs()) -> None:
        self.arch, self.layout, self.d, self.stages, self.pp_rank = arch, layout, d, stages, pp_rank
        dp = layout.fsdp_shards if layout.strategy.sharded else layout.grad_ranks
        self.fsdp = layout.grad_ranks > 1 and layout.strategy in (Strategy.zero2, Strategy.zero3)
        self.zero3 = self.fsdp and layout.strategy == Strategy.zero3
        rows = (lambda n: -(-n // dp)) if self.fsdp else (lambda n: n)
        frozen = [st.frozen_units or ((),) * len(st.units) for st in stages]  # a fine-tune's frozen parameters
        shapes = [(rows(a), b) for st in stages for u in st.units for a, b in u]  # trained
        held = [(rows(a), b) for fr in frozen for u in fr for a, b in u]
        self.params = sum(a * b for a, b in shapes) * d.pw + sum(a * b for a, b in held) * d.pf  # at rest
        # each unit unsharded, padded to dp chunks and at rest: its parameters (what FSDP gathers), and its trained
        # parameters alone (their gradients); both the same without a fine-tune
        g_units = [[_elements(u) * d.pw for u in st.units] for st in stages]
        g_padded = [[_elements(u, dp) * d.pw for u in st.units] for st in stages]
        self.units = [[g + _elements(f) * d.pf for g, f in zip(gs, fr)] for gs, fr in zip(g_units, frozen)]
        self.padded = [[g + _elements(f, dp) * d.pf for g, f in zip(gs, fr)] for gs, fr in zip(g_padded, frozen)]
        self.sharded = [[p // dp if self.fsdp else w for p, w in zip(ps, ws)]  # each unit at rest
                        for ps, ws in zip(self.padded, self.units)]
        self.g_units = g_units
        self.g_sharded = [[p // dp if self.fsdp else w for p, w in zip(ps, ws)] for ps, ws in zip(g_padded, g_units)]
        self.whole = [sum(u) for u in self.units]  # each stage's units unsharded (bytes)
        self.g_whole = [sum(u) for u in self.g_units]  # their gradients (bytes)
        self.g_at_shards = [sum(u) for u in self.g_sharded]  # their gradients, sharded (bytes)
        zero1 = layout.grad_ranks > 1 and layout.strategy == Strategy.zero1
        owned = zero_partition(shapes, layout.grad_ranks) if zero1 else shapes
        self.state = state_bytes(owned, optimizer, d.pw)
        if optimizer == OptimizerKind.sgd_momentum and not (self.fsdp or zero1):  # clones the whole-table gradient
            self.state += sum(st.grad_extra for st in stages)
        self.step_temps = step_temps(owned, optimizer, impl, d.pw)
        self.copies = sum(st.linear for st in stages) * d.c if d.autocast else 0
        # without pp, autocast's cache dies as forward ends: a checkpointed block saved no weight copy, and its
        # recompute makes its own again, one block at a time
        recomputed = [st for st in stages if Checkpointing(checkpointing) == Checkpointing.full and st.layers >= 2]
        self.freed = sum((st.layers - 1) * st.block_linear for st in recomputed) * d.c * (d.autocast and not d.pp)
        ddp = layout.strategy in (Strategy.ddp, Strategy.zero1) and layout.grad_ranks > 1
        self.buckets = sum(self.g_whole) if ddp else 0  # DDP's gradient buckets (zero1: DDP + ZeRO's optimizer)
        self.kept = batch_size * (arch.seq_len + 1) * 8  # token ids
        self.hidden = d.b * d.s * arch.hidden * d.r * d.pp  # one micro-batch's hidden states a stage sends (pp)
        self.held = knobs.grad_accum > 1  # the last micro-step of a step starts with the others' gradients
        # parameters at rest, gradients at the step, optimizer state (bytes), wherever offload keeps them
        self.at_rest = (self.params, self._grads(final=True), self.state)
        self._offload(knobs)

    def _offload(self, knobs: StepKnobs) -> None:
        """Take off the device what ZeRO-Offload keeps on the host, which steps the optimizer: the state and its
        temporaries (Ren et al. 2021). FSDP2's CPUOffloadPolicy (zero3) also keeps the sharded parameters there,
        and each gradient once reduce-scattered; the device keeps the gathered units and unreduced gradients."""
        if knobs.offload_optimizer or knobs.offload_params:
            self.state = self.step_temps = 0
        if knobs.offload_params:
            self.params = 0
            self.sharded = [[0] * len(units) for units in self.sharded]
            self.g_sharded = [[0] * len(units) for units in self.g_sharded]

    def peak(self) -> dict[str, int]:
        moments = self._schedule()
        moments.append(self._moment(0, self._grads(final=True), 0, 0, 0))  # the optimizer step
        moments[-1]["temporaries"] += self.step_temps
        return max(moments, key=lambda m: sum(m.values()))

    def _moment(self, unsharded: int, grads: int, acts: int, extra: int, copies: int) -> dict[str, int]:
        return {"parameters": self.params + unsharded + copies,
                "gradients": grads + self.buckets, "optimizer_state": self.state,
                "activations": acts + self.kept, "temporaries": max(extra, 0)}

    def _grads(self, final: bool = False) -> int:
        """Gradients of the stages whose backward ran (every stage at the step, `final`; every stage throughout the
        last micro-step of an accumulating step, `held`): FSDP keeps them unsharded until the step's reduce-scatter
        under pp (every backward but the last skips it), else shards them after each backward of the step's last
        micro-step (the earlier ones accumulate them unsharded)."""
        if not final:
            return self.sums[1]
        return sum(self._stage_grads(i, final=True) for i in range(len(self.stages)))

    def _stage_grads(self, i: int, final: bool) -> int:
        ran = final or self.backwards[i] > 0
        if not (ran or self.held):
            return 0
        reduced = final or (ran and not self.d.pp)
        return self.g_at_shards[i] if self.fsdp and reduced else self.g_whole[i] + self.stages[i].grad_extra

    def _schedule(self) -> list[dict[str, int]]:
        count = len(self.stages)
        self.inflight, self.forwards, self.backwards = [0] * count, [0] * count, [0] * count
        self.gathered = [False] * count  # FSDP: the stage's units unsharded
        # each stage's share of _acts, _grads and the gathered units now, and their sums, kept as the schedule runs
        self.shares = [(0, 0, 0)] * count
        self.sums = [0, 0, 0]
        for i in range(count):
            self._touch(i)
        out: list[dict[str, int]] = []
        for kind, i in schedule_order(self.layout, self.pp_rank):
            out += self._forward(i) if kind == "F" else self._backward(i)
        return out

    def _touch(self, i: int) -> None:
        """Stage i's counts changed: its shares, and their sums, again."""
        st, k, fwd, bwd = self.stages[i], self.inflight[i], self.forwards[i], self.backwards[i]
        grads = min(bwd, 1) if self.layout.schedule == PipelineSchedule.one_f_one_b else bwd
        outputs = fwd - k if self.layout.schedule == PipelineSchedule.interleaved_1f1b else 0
        acts = st.saved * k + self.hidden * (grads * (not st.first) + outputs * (not st.last))
        share = (acts, self._stage_grads(i, final=False), self.whole[i] if self.gathered[i] else 0)
        self.sums = [total - old + new for total, old, new in zip(self.sums, self.shares[i], share)]
        self.shares[i] = share

    def _acts(self) -> int:
        """Saved bytes of the micro-batches in flight, and the hidden states a send still holds: 1F1B's keeps a
        stage's last input gradient until the next backward's; GPipe's every input gradient until the step ends;
        the interleaved schedule's runtime every output and input gradient it sent until the step ends."""
        return self.sums[0]

    def _now(self, acts: int, extra: int, unsharded: int = 0, copies: bool = True, freed: int = 0,
             grads: int = 0) -> dict[str, int]:
        """The moment's parts: `copies`, whether autocast's weight copies are alive (less `freed` bytes of them);
        `grads`, gradient bytes beyond those of the stages whose backward ran."""
        gathered = self.sums[2]
        return self._moment(gathered + unsharded, self._grads() + grads, acts, extra,
                            self.copies * copies - freed)

    def _forward(self, i: int) -> list[dict[str, int]]:
        """The end of a micro-batch's forward on the last stage: the output layer's logits (FSDP: the root unit
        gathered, one block's all-gather output still held), then the loss."""
        st, out = self.stages[i], []
        self.inflight[i] += 1
        self.forwards[i] += 1
        if self.fsdp:  # ZeRO-3 reshards each unit after its forward, ZeRO-2 keeps them until the backward's end
            self.gathered[i] = not self.zero3
        self._touch(i)
        if st.last:
            acts = self._acts()
            now = (self.units[i][-1] * self.zero3 + self._gather_buffer(i)) * self.fsdp
            out = [self._now(acts + st.output_extra, 0, now), self._now(acts, st.loss_extra)]
        return out

    def _backward(self, i: int) -> list[dict[str, int]]:
        """The start of a micro-batch's backward, the last stage's output layer's backward, and the end (where a
        first stage's embedding backward makes whole-table gradients, added into the kept ones after its first).
        Under pp autocast's weight copies outlive a micro-batch, so their casts' backward nodes are older than any
        of a later micro-batch's and autograd runs them last: that backward ends holding the gradients of every
        weight copy of the stage, then casts them to fp32 one by one."""
        st, acts, again = self.stages[i], self._acts(), self.backwards[i] > 0 or self.held
        block = st.block_bwd[again]
        if self.zero3 and self.d.pp and not self.gathered[i]:  # the last block gathered, the next one's prefetched
            block += self.units[i][-2 if len(self.units[i]) > 1 else -1] + self._gather_buffer(i) * (1 + self.d.gloo)
        # a later stage's backward starts holding the gradient of its output, received (pipeline.LeanStage)
        grad_in = self.hidden * (not st.last)
        out = [self._now(acts + grad_in, st.head_bwd if st.last else block, freed=self.freed)]
        if st.last:
            out += self._head_backward(i, acts)
        out.append(self._first_block(i, again, grad_in))
        if self.zero3 and not self.d.pp and len(self.units[i]) > 2:
            out.append(self._second_block(i, again))
        self.inflight[i] -= 1
        self.backwards[i] += 1
        self.gathered[i] = self.fsdp and self.d.pp  # pipelining keeps FSDP's units gathered until the step
        self._touch(i)
        late = self.d.autocast and self.d.pp
        end = st.linear * self.d.c + max(st.embed_grad, st.largest) if late else st.embed_grad
        out.append(self._now(self._acts(), end * again, copies=self.d.pp))
        return out

    def _first_block(self, i: int, again: bool, grad_in: int = 0) -> dict[str, int]:
        """As a micro-batch's backward reaches the stage's first block: the later blocks' and the head's gradients
        made (every gradient of the stage after its first backward), that block's saved tensors (recomputed under
        checkpointing) and its backward's temporaries. ZeRO-3 without pp holds the root and the block gathered."""
        st, units = self.stages[i], self.units[i]
        acts = self._acts() - st.saved + st.first_block + grad_in
        unsharded = 0
        if self.fsdp and not self.d.pp:
            unsharded = units[-1] + units[0] * (len(units) > 1) if self.zero3 else sum(units)
        grads = self._held_reduced(i, len(units) - 2) if again else self._early_grads(i)
        return self._now(acts, st.block_bwd[again], unsharded, grads=grads, freed=self.freed)

    def _second_block(self, i: int, again: bool) -> dict[str, int]:
        """ZeRO-3 without pp, as the stage's second block's backward runs: the root and the block gathered, the
        first block's all-gather prefetched and the third's reduce-scatter input still held, the later blocks'
        gradients reduce-scattered to their shards and the root's whole."""
        st, units, d = self.stages[i], self.units[i], self.d
        acts = self._acts() - st.saved + st.first_block + st.per_layer
        blocks = len(units) - 1
        embed = st.embed_grad - st.grad_extra
        grads = (blocks - 2) * self.g_sharded[i][0] + self.g_units[i][-1] - embed
        buffer = self.padded[i][0]
        extra = 2 * buffer + max(buffer * d.gloo, st.block_bwd[again])
        grads = self._held_reduced(i, blocks - 2) if again else grads
        return self._now(acts, extra, units[-1] + units[0], grads=grads, freed=self.freed)

    def _held_reduced(self, i: int, done: int) -> int:
        """Less the held gradients of stage i that the last micro-step of an accumulating step has reduce-scattered
        by now, FSDP without pp: `done` blocks' unsharded gradients gone to their shards (bytes, <= 0)."""
        if not (self.held and self.fsdp and not self.d.pp and self.backwards[i] == 0):
            return 0
        return -max(done, 0) * (self.g_units[i][0] - self.g_sharded[i][0])

    def _early_grads(self, i: int) -> int:
        """Gradient bytes of stage i before its first block's backward: every other block's and the head's. FSDP
        without pp has reduce-scattered each finished block's to its shard; the root's wait for the root's end."""
        st, units = self.stages[i], self.g_units[i]
        embed = st.embed_grad - st.grad_extra
        later = sum(units) - st.block_bytes - embed
        if not self.fsdp or self.d.pp:
            return later
        blocks = max(len(units) - 2, 0)  # the units but the first block and the root
        return blocks * self.g_sharded[i][0] + units[-1] - embed

    def _gather_buffer(self, i: int) -> int:
        """FSDP2's all-gather output of one block of the stage (padded), held until the next gather's."""
        return self.padded[i][-2] if len(self.padded[i]) > 1 else 0

    def _head_backward(self, i: int, acts: int) -> list[dict[str, int]]:
        """As the output layer's backward runs: the log-softmax freed, the logits' fp32 gradient, the output weight's
        new gradient and the input's. ZeRO-3 without pp has gathered the root again and prefetched the last block;
        then, as that block's backward starts, it holds the root and the block gathered, the next block's gather
        prefetched (gloo's buffer beside it while it runs), the head's gradients."""
        st, d, units = self.stages[i], self.d, self.units[i]
        bth = d.b * d.T * self.arch.hidden
        refetch = self.zero3 and not self.gathered[i]
        buffer = self._gather_buffer(i) * refetch
        extra = st.log_softmax + st.head_grad + bth * d.c + buffer * (1 + d.gloo * d.pp)
        output = self._now(acts - st.log_softmax, extra, units[-1] * refetch, freed=self.freed)
        again = self.backwards[i] > 0 or self.held
        if not refetch:  # the last block's backward, the head's saved tensors freed
            extra = st.block_bwd[again] + bth * d.r
            return [output, self._now(acts - st.head, extra, grads=0 if again else st.head_grad, freed=self.freed)]
        block = units[0] if len(units) > 1 else 0
        extra = st.head_grad + buffer + max(buffer * d.gloo, st.block_bwd[0]) + bth * d.r
        freed = st.head_grad // d.r * d.c * d.autocast  # the output layer's weight copy, its backward done
        return [output, self._now(acts - st.head, extra, units[-1] + block, freed=freed + self.freed)]


def _elements(unit: tuple[tuple[int, int], ...], dp: int = 1) -> int:
    """Elements of a unit's shapes, each one's dim 0 padded to a multiple of `dp` (FSDP2's chunks)."""
    return sum(-(-a // dp) * dp * b for a, b in unit)


def zero_partition(shapes: list[tuple[int, int]], ranks: int) -> list[tuple[int, int]]:
    """The parameters ZeroRedundancyOptimizer gives its fullest rank of `ranks`: largest first, each to the rank
    holding the fewest elements so far (torch.distributed.optim's greedy partition, one parameter group)."""
    owned: list[list[tuple[int, int]]] = [[] for _ in range(ranks)]
    sizes = [0] * ranks
    for a, b in sorted(shapes, key=lambda s: s[0] * s[1], reverse=True):
        rank = sizes.index(min(sizes))
        owned[rank].append((a, b))
        sizes[rank] += a * b
    return owned[sizes.index(max(sizes))]


def state_bytes(shapes: list[tuple[int, int]], optimizer: OptimizerKind, r: int) -> int:
    """torch.optim's state for these local tensors: STATE_PER_PARAM tensors like each, Adam's and Adagrad's fp32
    step counter; row-wise Adagrad one fp32 value per row of a matrix (training.RowWiseAdagrad)."""
    if optimizer == OptimizerKind.rowwise_adagrad:
        return sum((a if b > 1 else a * b) * F32 for a, b in shapes)
    steps = F32 * len(shapes) if optimizer in (OptimizerKind.adam, OptimizerKind.adamw, OptimizerKind.adagrad) else 0
    return STATE_PER_PARAM[optimizer] * sum(a * b for a, b in shapes) * r + steps


def step_temps(shapes: list[tuple[int, int]], optimizer: OptimizerKind, impl: str | None, r: int) -> int:
    """Temporaries of the optimizer step: the per-parameter loop holds one tensor's (Adam: sqrt of the second moment
    and its quotient; Adagrad: the sqrt), foreach every tensor's at once, fused none."""
    per = {OptimizerKind.adam: 2, OptimizerKind.adamw: 2, OptimizerKind.adagrad: 1}.get(optimizer, 0)
    if impl == "fused":
        return 0
    if optimizer == OptimizerKind.rowwise_adagrad:  # grad.float() where not fp32, then its square
        return max((a * b * F32 * (1 if r == F32 else 2) for a, b in shapes), default=0)
    if impl == "foreach":
        return min(per, 1) * sum(a * b for a, b in shapes) * r
    return per * max((a * b for a, b in shapes), default=0) * r

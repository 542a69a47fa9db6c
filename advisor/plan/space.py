"""The configurations the planner considers on one hardware target: meshes dp x cp x tp x pp, each data-parallel
strategy (HSDP over nodes), pipeline schedules, micro-batch sizes that split the global batch; the checkpointing
and offload a family of them tries are the search's (search.py). Rules are advisor/parallel/layout.py's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from pydantic import ValidationError

from advisor.config import Checkpointing, OptimizerKind, Precision, Strategy
from advisor.errors import invalid_input
from advisor.hardware.spec import HardwareSpec
from advisor.parallel.layout import PipelineSchedule, layout_problems
from advisor.plan.knobs import FixedKnobs, Offload, PlanConfig
from advisor.workload import DecoderArch

DEFAULT_PRECISION = Precision.bf16
DEFAULT_OPTIMIZER = OptimizerKind.adamw
CHECKPOINTING = (Checkpointing.none, Checkpointing.selective, Checkpointing.full)  # least recompute first
STRATEGIES = (Strategy.ddp, Strategy.zero1, Strategy.zero2, Strategy.zero3)


@dataclass
class Rejections:
    """Why values the fixed knobs allow were ruled out: the first reason, for the error when nothing is left."""

    first: str | None = None
    count: int = 0

    def add(self, why: str) -> None:
        self.first = self.first or why
        self.count += 1


@dataclass(frozen=True)
class Family:
    """Configurations alike but for micro_batch_size (and microbatches or grad_accum with it), checkpointing and
    offload: `configs` yields them smallest micro-batch first, checkpointing and offload left as given."""

    base: PlanConfig  # micro_batch_size 1, the rest as every member has it
    sizes: tuple[int, ...] = field(default=())  # micro-batch sizes, ascending

    def config(self, size: int, checkpointing: Checkpointing, offload: Offload) -> PlanConfig:
        per_replica = self.base.micro_batch_size * self.base.microbatches * self.base.grad_accum
        steps = per_replica // size
        pp = self.base.pp > 1
        return self.base.model_copy(update={"micro_batch_size": size, "microbatches": steps if pp else 1,
                                            "grad_accum": 1 if pp else steps, "checkpointing": checkpointing,
                                            "offload": offload})


def families(arch: DecoderArch, hw: HardwareSpec, global_batch: int, fixed: FixedKnobs,
             why: Rejections, frugal: bool = False, dp_only: bool = False) -> Iterator[Family]:
    """Every family of configurations of `arch` on `hw` at `global_batch` samples per step that `fixed` admits.
    `frugal`: only the least memory of each mesh (ZeRO-3 where the strategy is free, 1F1B), for a fit check;
    `dp_only`: data parallel alone (tp, cp, pp 1, no HSDP), the layouts a fine-tune's trial runs."""
    world = hw.world_size
    meshes = [(1, 1, 1)] if dp_only else _meshes(arch, hw, fixed, why)
    for tp, cp, pp in meshes:
        dp = world // (tp * cp * pp)
        if global_batch % dp:
            why.add(f"global batch {global_batch} does not split over dp {dp} (tp {tp} x cp {cp} x pp {pp} on "
                    f"{world} devices); use a multiple of {dp}")
            continue
        if fixed.dp is not None and fixed.dp != dp:
            continue
        sp = tp > 1 and (arch.seq_len // cp) % tp == 0 if fixed.sequence_parallel is None else fixed.sequence_parallel
        for strategy, replicate in _strategies(hw, dp, tp, cp, pp, fixed, frugal):
            if dp_only and replicate > 1:
                continue
            for schedule, virtual in _schedules(arch, pp, fixed, frugal, why):
                base = PlanConfig(dp=dp, tp=tp, pp=pp, cp=cp, dp_replicate=replicate, strategy=strategy,
                                  schedule=schedule, virtual_stages=virtual, microbatches=global_batch // dp,
                                  micro_batch_size=1, grad_accum=1, checkpointing=Checkpointing.none,
                                  precision=fixed.precision or DEFAULT_PRECISION,
                                  optimizer=fixed.optimizer or DEFAULT_OPTIMIZER, sequence_parallel=sp)
                problems = _problems(base, world, arch)
                if problems:
                    why.add(problems[0])
                    continue
                sizes = _sizes(global_batch // dp, base, fixed, why)
                if sizes:
                    yield Family(base=base, sizes=sizes[:1] if frugal else sizes)


def _problems(config: PlanConfig, world: int, arch: DecoderArch) -> list[str]:
    """layout.py's objections to the configuration's layout, one line each."""
    try:
        layout = config.layout()
    except ValidationError as exc:
        return [invalid_input(exc).args[0]]
    return layout_problems(layout, world=world, decoder=arch, model_name="the model")


def _meshes(arch: DecoderArch, hw: HardwareSpec, fixed: FixedKnobs, why: Rejections) -> Iterator[tuple[int, ...]]:
    """(tp, cp, pp) that divide the devices and the model: tp within a node and dividing heads, kv_heads and the
    FFN; cp a power of 2 whose 2 x cp chunks split the sequence; pp at most the layers (no tied output), the
    layers split as evenly as they allow, the remainder to the first stages (Layout.split)."""
    world = hw.world_size
    for tp in _divisors(world) if fixed.tp is None else [fixed.tp]:
        if world % tp:
            why.add(f"tp {tp} does not divide the {world} devices of {hw.accelerator.name}")
            continue
        if tp > hw.devices_per_node:
            why.add(f"tp {tp} would span nodes ({hw.devices_per_node} devices per node); tensor parallel stays "
                    f"within a node: tp at most {hw.devices_per_node}")
            continue
        if arch.heads % tp or arch.kv_heads % tp or arch.ffn_hidden % tp:
            allowed = [d for d in _divisors(arch.kv_heads) if arch.heads % d == 0 and arch.ffn_hidden % d == 0]
            why.add(f"tp {tp} does not divide the model's heads ({arch.heads}), kv_heads ({arch.kv_heads}) and ffn "
                    f"({arch.ffn_hidden}); tp may be {', '.join(map(str, allowed))}")
            continue
        for cp in _powers(world // tp) if fixed.cp is None else [fixed.cp]:
            if (world // tp) % cp or arch.seq_len % (2 * cp):
                why.add(f"cp {cp} needs seq_len {arch.seq_len} a multiple of {2 * cp} and tp x cp = {tp * cp} "
                        f"dividing the {world} devices")
                continue
            left = world // (tp * cp)
            for pp in _divisors(left) if fixed.pp is None else [fixed.pp]:
                if left % pp or pp > arch.layers:
                    why.add(f"pp {pp} needs to divide the {left} devices left by tp {tp} x cp {cp} and to be at "
                            f"most the model's {arch.layers} layers")
                    continue
                if pp > 1 and arch.tied_embeddings:
                    why.add("pp needs an untied output layer; the model ties it to its embedding "
                            "(-a tie_embeddings=false)")
                    continue
                yield tp, cp, pp


def _strategies(hw: HardwareSpec, dp: int, tp: int, cp: int, pp: int, fixed: FixedKnobs,
                frugal: bool) -> Iterator[tuple[Strategy, int]]:
    """(strategy, dp_replicate): single without gradient averaging, else each strategy layout.py composes with
    the mesh, and HSDP (ZeRO within a node, replicated across nodes) where a node holds two or more shards. A fixed
    strategy or dp_replicate is yielded as given, for layout.py's checks to explain."""
    shard = hw.devices_per_node // (tp * cp) if hw.devices_per_node % (tp * cp) == 0 else 0
    replicas = [1] + ([dp // shard] if not frugal and shard >= 2 and dp % shard == 0 and dp > shard else [])
    if fixed.dp_replicate is not None:
        replicas = [fixed.dp_replicate]
    if fixed.strategy is not None:
        strategies = [fixed.strategy]
    elif dp * cp == 1:
        strategies = [Strategy.single]
    elif frugal:
        strategies = [Strategy.zero3]  # the least memory of the four
    else:  # DTensor parameters (tp) need FSDP2: DDP (and zero1, DDP under a sharded optimizer) cannot hold them
        strategies = [s for s in STRATEGIES if not (tp > 1 and s in (Strategy.ddp, Strategy.zero1))]
    for replicate in replicas:
        for strategy in strategies:
            if replicate == 1 or strategy in (Strategy.zero2, Strategy.zero3) or fixed.strategy is not None:
                yield strategy, replicate


def _schedules(arch: DecoderArch, pp: int, fixed: FixedKnobs, frugal: bool,
               why: Rejections) -> Iterator[tuple[PipelineSchedule | None, int]]:
    """(schedule, virtual stages): none without pp; 1F1B, and interleaved 1F1B over each number of virtual
    stages (2 or more) that splits every rank's layers evenly."""
    if pp == 1:
        if fixed.schedule is None and fixed.virtual_stages in (None, 1):
            yield None, 1
        else:
            why.add("a pipeline schedule and virtual_stages need pp > 1")
        return
    per_rank = arch.layers // pp
    virtual = _virtual(arch.layers, pp)
    options = [(PipelineSchedule.one_f_one_b, 1)]
    if not frugal or fixed.schedule == PipelineSchedule.interleaved_1f1b:
        options += [(PipelineSchedule.interleaved_1f1b, v) for v in virtual]
    kept = [(s, v) for s, v in options
            if (fixed.schedule or s) == s and (fixed.virtual_stages or v) == v]
    if not kept:
        why.add(f"schedule {(fixed.schedule or PipelineSchedule.interleaved_1f1b).value} with virtual_stages "
                f"{fixed.virtual_stages} does not split the {arch.layers} layers over pp {pp} ranks ({per_rank} "
                f"or more each) into stages of near-equal size; virtual_stages may be "
                f"{', '.join(map(str, virtual)) or 'none'}")
    yield from kept[:1] if frugal else kept


def _sizes(per_replica: int, base: PlanConfig, fixed: FixedKnobs, why: Rejections) -> tuple[int, ...]:
    """Micro-batch sizes (powers of 2, or the fixed one) that split a replica's `per_replica` samples per step:
    under pp into at least pp micro-batches (a multiple of pp when interleaved), else into grad_accum steps."""
    sizes = [fixed.micro_batch_size] if fixed.micro_batch_size is not None else _powers(per_replica)
    out = []
    for size in sizes:
        steps, rest = divmod(per_replica, size)
        if rest:
            why.add(f"micro_batch_size {size} does not divide the {per_replica} samples each of the dp {base.dp} "
                    "replicas takes per step")
            continue
        if base.pp > 1:
            if steps < base.pp or (base.virtual_stages > 1 and steps % base.pp):
                why.add(f"{per_replica} samples per replica in micro-batches of {size} make {steps} micro-batches; "
                        f"pp {base.pp} needs at least {base.pp}" + (", a multiple of pp" if base.virtual_stages > 1
                                                                     else ""))
                continue
            if (fixed.microbatches or steps) != steps or fixed.grad_accum not in (None, 1):
                continue
        elif (fixed.grad_accum or steps) != steps or fixed.microbatches not in (None, 1):
            continue
        out.append(size)
    if not out and (fixed.microbatches or fixed.grad_accum):
        why.add(f"microbatches {fixed.microbatches or 1} x grad_accum {fixed.grad_accum or 1} does not split the "
                f"{per_replica} samples each of the dp {base.dp} replicas takes per step (under pp: microbatches, "
                "else grad_accum)")
    return tuple(out)


def _virtual(layers: int, pp: int) -> list[int]:
    """Virtual stages (2 or more) per pipeline rank that cut `layers` into pp x v stages of at least one layer
    whose sizes differ by at most one: divisors of the layers per rank, rounded down or up."""
    low, high = layers // pp, -(-layers // pp)
    return sorted({v for n in (low, high) for v in _divisors(n) if v >= 2 and pp * v <= layers})


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers(n: int) -> list[int]:
    """Powers of 2 that divide n, ascending."""
    out, p = [], 1
    while n % p == 0 and p <= n:
        out.append(p)
        p *= 2
    return out

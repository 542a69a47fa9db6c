"""One rank's program in a parallel run: its part of the model (a pipeline stage or the whole), tensor parallel
applied, the data-parallel strategy around it, its optimizer, and a training step.

The measured trial runs it on real ranks; the estimator runs the same program under fake tensors and a fake
process group of the layout's size, so what it predicts is what this code allocates.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from advisor.config import Checkpointing, OptimizerKind, Precision, Strategy
from advisor.parallel.layout import MESH_DIMS, Layout
from advisor.workload import Workload


@dataclass
class RankProgram:
    """What one rank runs. `model` holds every parameter this rank owns (a ModuleList of stages under pp);
    `step(batch, phase)` is one optimizer step on this rank's share of `batch` (the dp replica's samples: the
    whole of it on every tp rank, split into micro-batches along the pipeline)."""

    layout: Layout
    coords: dict[str, int]
    model: nn.Module
    optimizers: list[torch.optim.Optimizer]
    step: Callable[..., Any]
    mesh: Any = None
    notes: list[str] = field(default_factory=list)


def build_program(workload: Workload, layout: Layout, *, rank: int, device_type: str, device: Any,
                  precision: Precision, optimizer: OptimizerKind, optimizer_impl: str | None = None,
                  checkpointing: Checkpointing = Checkpointing.none, batch_size: int,
                  build: Callable[[], nn.Module] | None = None,
                  mesh: Any = None) -> RankProgram:
    """This rank's program, in a process group of `layout.world` ranks that is already initialised.

    A model that initialises itself (`init_weights()`, as the decoder presets do) is built on the meta device,
    cut to this rank's pipeline stages and sharded for tensor parallel there, and only then given memory on
    `device` and initialised: no rank ever holds the whole model. Any other model is built whole by `build`
    (default `workload.build`) and then sharded. `mesh`: the layout's device mesh (`make_mesh`), made here where
    not given."""
    mesh = mesh if mesh is not None else make_mesh(layout, device_type)
    coords = layout.coords(rank)
    if layout.pp > 1:
        return _pipeline_program(workload, layout, mesh, coords, device=device, device_type=device_type,
                                 precision=precision, optimizer=optimizer, optimizer_impl=optimizer_impl,
                                 checkpointing=checkpointing, batch_size=batch_size)
    from advisor.parallel.tensor import local_loss, loss_context
    from advisor.training import prepare, train_step

    sharded = vocab_parallel(workload, layout)
    model = _built_on_meta(workload)
    if model is not None:
        _tensor_parallel(model, layout, mesh, sharded, checkpointing)
        materialize(model, device)
        model.init_weights()
    else:
        model = _tensor_parallel((build or workload.build)().to(device), layout, mesh, sharded, checkpointing)
    shard = context_shard(layout, mesh, workload.decoder.seq_len) if layout.cp > 1 else None
    if shard is not None:
        from advisor.parallel.context import apply_context_parallel

        apply_context_parallel(model, shard)
    loss_fn = local_loss(workload.loss_fn) if sharded else workload.loss_fn
    ctx = prepare(model, loss_fn, precision=precision, optimizer=optimizer, device_type=device_type,
                  optimizer_impl=optimizer_impl, checkpointing=checkpointing,
                  wrap=lambda m: _data_parallel(m, layout, mesh, precision),
                  make_opt=lambda m: _make_optimizer(layout, mesh, optimizer, m, optimizer_impl))

    def step(batch: Any, phase: Callable[[str], None] | None = None, *, loss_scale: float = 1.0,
             optimizer_step: bool = True, **kwargs: Any) -> Any:
        """Forward and backward of `batch`, its loss times `loss_scale`; with `optimizer_step` the data-parallel
        gradients are reduced and the optimizer steps, else they accumulate for a later micro-step."""
        from advisor.parallel.accumulate import gradient_sync

        if shard is not None:  # this rank's tokens of every sample, inputs and targets alike
            batch = tuple(shard.shard(t) for t in batch)
        # loss_parallel's ops: train_step runs the loss and its backward
        with gradient_sync(ctx.model, optimizer_step, keep_gathered=layout.strategy.keeps_gathered), \
                loss_context(sharded):
            return train_step(ctx, batch, phase, loss_scale=loss_scale, step=optimizer_step, **kwargs)

    return RankProgram(layout=layout, coords=coords, model=ctx.model, optimizers=ctx.optimizers, step=step, mesh=mesh)


def make_mesh(layout: Layout, device_type: str) -> "RankMesh":
    """The device mesh of MESH_DIMS over the process group's ranks, with the flattened meshes the program reads.
    Made outside any fake-tensor mode: the mesh reads its own rank table."""
    from torch.distributed.device_mesh import init_device_mesh

    root = init_device_mesh(device_type, (layout.pp, layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp),
                            mesh_dim_names=MESH_DIMS)
    dp_cp = root["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    derived = {"dp": root["dp_replicate", "dp_shard"]._flatten("dp"), "dp_cp": dp_cp,
               "dp_shard_cp": root["dp_shard", "cp"]._flatten("dp_shard_cp")}
    if layout.dp_replicate > 1:
        derived["hsdp"] = dp_cp._unflatten(0, (layout.dp_replicate, layout.dp_shard * layout.cp),
                                           ("dp_replicate", "dp_shard_cp"))
    return RankMesh(root, derived)


class RankMesh:
    """A layout's device mesh (`root`, dimensions MESH_DIMS) and the meshes derived from it, by name: "dp"
    (dp_replicate x dp_shard), "dp_cp" (every rank that averages the same gradients: DDP's group), "dp_shard_cp"
    (the ranks FSDP shards over: context-parallel ranks hold the same parameters) and, under HSDP, "hsdp"
    (dp_replicate x dp_shard_cp, FSDP2's 2-D mesh). torch keeps flattened meshes apart from the root's slicing."""

    def __init__(self, root: Any, derived: dict[str, Any]) -> None:
        self.root, self.derived = root, derived

    def __getitem__(self, name: str) -> Any:
        return self.derived[name] if name in self.derived else self.root[name]


def context_shard(layout: Layout, mesh: Any, seq_len: int) -> Any:
    """This rank's ContextShard under cp > 1, else None."""
    if layout.cp == 1:
        return None
    from advisor.parallel.context import ContextShard

    return ContextShard(group=mesh["cp"].get_group(), rank=mesh["cp"].get_local_rank(), size=layout.cp,
                        seq_len=seq_len)


def _built_on_meta(workload: Workload) -> nn.Module | None:
    """The workload's model built on the meta device where it can initialise itself afterwards, else None."""
    if workload.decoder is None:
        return None
    with torch.device("meta"):
        model = workload.build_model()
    return model if callable(getattr(model, "init_weights", None)) else None


def vocab_parallel(workload: Workload, layout: Layout) -> bool:
    """Whether the program keeps the logits sharded over tp's ranks and computes a vocabulary-parallel loss: a
    decoder preset (its loss, token_cross_entropy, takes the shards) under tp > 1."""
    return layout.tp > 1 and workload.decoder is not None


def _tensor_parallel(module: nn.Module, layout: Layout, mesh: Any, loss_parallel: bool = False,
                     checkpointing: Checkpointing = Checkpointing.none) -> nn.Module:
    from advisor.parallel.tensor import apply_tensor_parallel

    if layout.tp > 1:
        apply_tensor_parallel(module, mesh["tp"], sequence_parallel=layout.sequence_parallel,
                              loss_parallel=loss_parallel, regather=Checkpointing(checkpointing) != Checkpointing.full)
    return module


def _data_parallel(module: nn.Module, layout: Layout, mesh: Any, precision: Precision) -> nn.Module:
    """The data-parallel strategy over the dp x cp ranks, around the tensor-parallel module (torchtitan's order)."""
    import warnings

    # FSDP2 warns of every root module that returns a view (the logits): an in-place op on it would skip its
    # backward hook, and the losses here make none
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    if precision == Precision.bf16_pure:
        module.to(torch.bfloat16)  # FSDP2 and DDP size their buffers from the dtype at wrap time
    if layout.grad_ranks == 1:
        return module
    if layout.strategy in (Strategy.ddp, Strategy.zero1):  # zero1: DDP, its optimizer sharded (_make_optimizer)
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, process_group=mesh["dp_cp"].get_group())
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from advisor.training import repeated_blocks

    # HSDP: shard within each dp_shard x cp group, replicate across the dp_replicate groups
    dp_mesh = mesh["hsdp"] if layout.dp_replicate > 1 else mesh["dp_shard_cp"]
    reshard = layout.strategy == Strategy.zero3
    policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None)  # autocast casts per op, as in a trial
    for block in repeated_blocks(module):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    return module


def _make_optimizer(layout: Layout, mesh: Any, kind: OptimizerKind, model: nn.Module,
                    impl: str | None) -> torch.optim.Optimizer:
    """The optimizer of `model`'s trainable parameters: under zero1, ZeroRedundancyOptimizer over the ranks that
    average gradients (dp x cp), each stepping its greedy share and broadcasting it; else one optimizer."""
    from advisor.training import make_optimizer, optimizer_spec

    params = [p for p in model.parameters() if p.requires_grad]
    if layout.strategy != Strategy.zero1 or layout.grad_ranks == 1:
        return make_optimizer(kind, params, impl)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    cls, kw = optimizer_spec(kind, impl)
    return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=mesh["dp_cp"].get_group(), **kw)


def materialize(module: nn.Module, device: Any) -> None:
    """Give each meta-device parameter and buffer of `module` uninitialised memory on `device`, in place: a
    DTensor keeps its placements, with a local shard of its own size (as `to_empty`, whose tensor swap refuses a
    fake tensor)."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None and p.is_meta:
                sub._parameters[name] = nn.Parameter(_empty_like(p, device), p.requires_grad)
        for name, b in list(sub._buffers.items()):
            if b is not None and b.is_meta:
                sub._buffers[name] = _empty_like(b, device)


def _empty_like(t: torch.Tensor, device: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        local = torch.empty_like(t.to_local(), device=device)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride())
    return torch.empty_like(t, device=device)


def _pipeline_program(workload: Workload, layout: Layout, mesh: Any, coords: dict[str, int], *, device: Any,
                      device_type: str, precision: Precision, optimizer: OptimizerKind, optimizer_impl: str | None,
                      checkpointing: Checkpointing, batch_size: int) -> RankProgram:
    """Under pp: this rank's stages built from a meta-device decoder, sharded, scheduled."""
    from advisor.parallel.pipeline import build_stages, make_schedule
    from advisor.parallel.tensor import local_loss, loss_context
    from advisor.presets._util import token_cross_entropy
    from advisor.training import apply_activation_checkpointing

    arch = workload.decoder
    if arch is None:
        raise ValueError(f"pp needs a decoder; {workload.name} is not one")
    if precision == Precision.fp16:
        raise ValueError("fp16 with pp is not supported (its loss scaler would need every stage's inf check); "
                         "use bf16")
    with torch.device("meta"):
        decoder = workload.build_model()
    stages = build_stages(decoder, layout, coords["pp"])
    sharded = vocab_parallel(workload, layout)
    for stage in stages:
        _tensor_parallel(stage, layout, mesh, sharded, checkpointing)
        materialize(stage, device)
    decoder.init_weights()  # the meta-device layers of other ranks' stages cost nothing
    shard = context_shard(layout, mesh, arch.seq_len)
    scheduled = []  # each stage as the schedule runs it: itself under FSDP2 (in place), its DDP wrapper
    for stage in stages:
        if shard is not None:
            from advisor.parallel.context import apply_context_parallel

            apply_context_parallel(stage, shard)
        if checkpointing:
            apply_activation_checkpointing(stage, checkpointing)
        scheduled.append(_data_parallel(stage, layout, mesh, precision))
    dtype = torch.bfloat16 if precision == Precision.bf16_pure else torch.float32
    autocast = precision.autocast_dtype
    schedule = make_schedule(scheduled, layout, pp_rank=coords["pp"], group=mesh["pp"].get_group(), device=device,
                             microbatch=batch_size // layout.n_microbatches, seq_len=arch.seq_len // layout.cp,
                             hidden=arch.hidden,
                             vocab=arch.vocab, tp_shards=layout.tp if layout.sequence_parallel else 1,
                             loss_fn=local_loss(token_cross_entropy) if sharded else token_cross_entropy,
                             hidden_dtype=dtype, logits_dtype=autocast or dtype)
    model = nn.ModuleList(stages)
    opt = _make_optimizer(layout, mesh, optimizer, model, optimizer_impl)
    first, last = stages[0].first, stages[-1].last

    def step(batch: Any, phase: Callable[[str], None] | None = None, *, loss_scale: float = 1.0,
             optimizer_step: bool = True, **_: Any) -> None:
        """The schedule's micro-batches of `batch`, each loss times `loss_scale`; with `optimizer_step` the
        gradients are reduced and scaled and the optimizer steps, else they accumulate for a later call."""
        from advisor.parallel.accumulate import pipeline_accumulation

        phase = phase or (lambda _name: None)
        inputs, targets = (shard.shard(t) for t in batch) if shard is not None else batch
        phase("forward")  # forwards and backwards interleave by micro-batch: one phase for both
        # the last stage's losses and their backwards run inside the schedule's step
        with torch.autocast(device_type, dtype=autocast) if autocast else contextlib.nullcontext(), \
                pipeline_accumulation(schedule, loss_scale, sync=optimizer_step), loss_context(sharded):
            args = (inputs.contiguous(),) if first else ()  # the stage was declared with contiguous ids
            schedule.step(*args, target=targets if last else None, return_outputs=False)
        if not optimizer_step:
            return
        phase("step")
        opt.step()
        opt.zero_grad(set_to_none=True)
        phase("done")

    return RankProgram(layout=layout, coords=coords, model=model, optimizers=[opt], step=step, mesh=mesh)

"""Tensor parallel as Megatron-LM lays it out, run by DTensor's `parallelize_module`.

Attention's q, k, v projections and the FFN's first matrices split column-wise (each rank holds heads/tp heads and
ffn/tp of the inner width), the output projections row-wise; with sequence parallel the norms and residual stream
between them hold seq_len/tp tokens per rank, gathered before each column-wise region and reduce-scattered after
the row-wise one (Korthikanti et al. 2022); as in Megatron-LM, a region's gathered input is held for backward as
the rank's shard and gathered again there. With a vocabulary-parallel loss the output layer's logits stay split
over the vocabulary (each rank vocab/tp of them) and torch's `loss_parallel` computes the cross entropy from the
shards, all-reducing per-token maxima and sums (Megatron-LM's and torchtitan's layout). A model that is not a
decoder gets its consecutive Linear pairs split column- then row-wise; what no plan covers is replicated.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

# The decoder layout (advisor/presets/decoders.py): FFN matrices by kind; w1 and w3 feed w2, fc feeds proj.
FFN_COLUMN = ("w1", "w3", "fc")
FFN_ROW = ("w2", "proj")


def is_decoder(model: Any) -> bool:
    """Whether `model` has the decoder layout the plan names: blocks of attn (wq, wk, wv, wo) and ffn, with the
    embeddings, final norm and output where it holds them (a pipeline stage may hold none)."""
    blocks = getattr(model, "blocks", None)
    return bool(blocks) and all(hasattr(b, "attn") and hasattr(b, "ffn") and hasattr(b.attn, "wq") for b in blocks)


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, *, sequence_parallel: bool = True,
                          loss_parallel: bool = False, regather: bool = True) -> nn.Module:
    """Shard `model` over the 1-D tensor-parallel `mesh` in place; returns it. Every parameter becomes a DTensor
    on `mesh` (sharded or replicated), so one optimizer steps them all. `loss_parallel`: a decoder's logits leave
    the output layer as a DTensor sharded over the vocabulary (its loss must run under `loss_context`).
    `regather` (a decoder under sequence parallel): each block keeps its sequence shard of what its attention and
    FFN gather, and gathers it again in backward (`_RegatherInBackward`); off where the block's forward is
    recomputed whole (full checkpointing), which gathers it again anyway."""
    from torch.distributed.tensor.parallel import parallelize_module

    decoder = is_decoder(model)
    plan = decoder_plan(model, sequence_parallel, loss_parallel) if decoder else pair_plan(model)
    tied = _tied(model)
    parallelize_module(model, mesh, plan)
    if tied:  # parallelize_module distributed each module's copy of the tied weight apart; tie them again
        model.output.weight = model.tok_embeddings.weight
    _replicate_rest(model, mesh)
    if decoder and sequence_parallel and regather:
        for block in model.blocks:
            _RegatherInBackward.wrap(block.attn)
            _RegatherInBackward.wrap(block.ffn)
    return model


class _RegatherInBackward:
    """Megatron-LM's sequence parallel: what a column-parallel region reads, its input all-gathered over the
    sequence, is saved for backward as this rank's shard and gathered again when backward reads it.

    Without it each of the region's projections saves the gathered input (under autocast, each its own cast of it):
    tp times the shard, per projection. Here the region casts the gathered input once (as autocast would for each
    projection: the same values), and the saved-tensor hooks pack each saved view of that one tensor as the shard,
    which the region's pre-hook kept; backward's first unpack gathers and casts it again, its last lets it go. The
    gather in backward is a collective every tp rank makes in the same order (their backward is the same program).
    """

    def __init__(self) -> None:
        self.shard: Any = None  # the input before PrepareModuleInput gathered it (a Shard(1) DTensor)

    @classmethod
    def wrap(cls, module: Any) -> None:
        self = cls()
        module.register_forward_pre_hook(self._keep, prepend=True)  # before PrepareModuleInput's gather
        inner = module.forward

        def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
            shard, self.shard = self.shard, None
            if shard is None or not _is_dtensor(x) or not torch.is_grad_enabled():
                return inner(x, *args, **kwargs)
            x = _autocast(x)
            region = _Gathered(shard, x)
            with torch.autograd.graph.saved_tensors_hooks(region.pack, region.unpack):
                return inner(x, *args, **kwargs)

        module.forward = forward

    def _keep(self, _module: Any, args: tuple) -> None:
        self.shard = args[0] if args and _is_dtensor(args[0]) else None


class _Gathered:
    """One region's forward: its gathered input `x` and the shard it was gathered from."""

    def __init__(self, shard: Any, x: Any) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self.shard, self.dtype, self.mesh = shard, x.dtype, x.device_mesh
        self.storage = StorageWeakRef(x._local_tensor.untyped_storage())
        self.pending = 0  # packed views not yet unpacked
        self.again: Any = None  # the gather backward made, while views of it are still to be unpacked

    def pack(self, t: Any) -> Any:
        from torch.multiprocessing.reductions import StorageWeakRef

        if not _is_dtensor(t) or StorageWeakRef(t._local_tensor.untyped_storage()) != self.storage:
            return t
        self.pending += 1
        local = t._local_tensor
        return (self, local.size(), local.stride(), local.storage_offset(), t.placements)

    def unpack(self, packed: Any) -> Any:
        if not (isinstance(packed, tuple) and len(packed) == 5 and packed[0] is self):
            return packed
        from torch.distributed.tensor import DTensor, Replicate

        _, size, stride, offset, placements = packed
        if self.again is None:
            with torch.no_grad():
                self.again = self.shard.redistribute(self.mesh, [Replicate()]).to(self.dtype)._local_tensor
        view = self.again.as_strided(size, stride, offset)
        self.pending -= 1
        if self.pending == 0:
            self.again = None
        return DTensor.from_local(view, self.mesh, placements, run_check=False)


def _is_dtensor(x: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def _autocast(x: Any) -> Any:
    """`x` in the dtype autocast computes a projection in, where autocast is on: each projection then saves it."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point():
        return x.to(torch.get_autocast_dtype(device))
    return x


def _tied(model: Any) -> bool:
    emb, out = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    return emb is not None and out is not None and out.weight is emb.weight


@contextlib.contextmanager
def loss_context(enabled: bool) -> Iterator[None]:
    """Where a step's loss and its backward run: under `loss_parallel()` (logits sharded over the vocabulary:
    cross entropy from the shards), else as they are."""
    from torch.distributed.tensor.parallel import loss_parallel

    if not enabled:
        yield
        return
    context = loss_parallel()
    context.__enter__()
    try:
        yield
    finally:  # torch's context leaves its ops registered with DTensor where the body raises
        context.__exit__(None, None, None)


@contextlib.contextmanager
def loss_ops_under(mode: Any) -> Iterator[None]:
    """While active, loss_parallel's computations on the local shards (torch.distributed.tensor.parallel.loss:
    the log-softmax, the loss, their fused backward) run with the dispatch mode `mode` entered again. DTensor runs
    them inside its own dispatch, where no mode above it sees them; so a rank's tracer or collective counter sees
    what they allocate (the shifted logits, their exponentials, the gradient's terms) and communicate (the
    all-reduces of each token's maximum, sum of exponentials and target logit), and not the global-shape fake
    tensors DTensor's sharding propagation makes beside them."""
    from torch.distributed.tensor.parallel import loss

    names = ("_log_softmax", "_nll_loss_forward", "_nll_loss_and_log_softmax_backward")
    kernels = {name: getattr(loss, name) for name in names}

    def seen(kernel: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with mode:
                return kernel(*args, **kwargs)

        return run

    for name, kernel in kernels.items():
        setattr(loss, name, seen(kernel))
    try:
        yield
    finally:
        for name, kernel in kernels.items():
            setattr(loss, name, kernel)


def local_loss(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    """`loss_fn` whose loss, a DTensor where it comes from sharded logits (the same on every tp rank), is returned
    as this rank's tensor: the step, its gradient scaler and a pipeline schedule see the plain scalar they see
    without tensor parallel, and backward goes through the DTensor's graph."""
    from torch.distributed.tensor import DTensor

    def local(*args: Any, **kwargs: Any) -> Any:
        loss = loss_fn(*args, **kwargs)
        return loss.to_local() if isinstance(loss, DTensor) else loss

    return local


def decoder_plan(model: Any, sequence_parallel: bool, loss_parallel: bool = False) -> dict[str, Any]:
    """parallelize_module's plan for a decoder (or a pipeline stage of one: the parts it holds); `loss_parallel`:
    the logits stay sharded over the vocabulary, else they are gathered whole on every rank."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    sp = sequence_parallel
    between = Shard(1) if sp else Replicate()  # the residual stream's layout between tp regions
    plan: dict[str, Any] = {}
    for name in ("tok_embeddings", "pos_embeddings"):
        if getattr(model, name, None) is not None:
            plan[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if getattr(model, "tok_embeddings", None) is not None and sp:
        # the embedding's output is whole on every rank: keep this rank's tokens for the first block
        plan["blocks.0"] = PrepareModuleInput(input_layouts=(Replicate(), None), desired_input_layouts=(Shard(1), None),
                                              use_local_output=True)
    for i, block in enumerate(model.blocks):
        prefix = f"blocks.{i}."
        if sp:
            plan[prefix + "attn_norm"] = SequenceParallel()
            plan[prefix + "ffn_norm"] = SequenceParallel()
        plan[prefix + "attn"] = PrepareModuleInput(input_layouts=(between, None),
                                                   desired_input_layouts=(Replicate(), None))
        plan[prefix + "ffn"] = PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),))
        for proj in ("wq", "wk", "wv"):
            plan[prefix + "attn." + proj] = ColwiseParallel()
        plan[prefix + "attn.wo"] = RowwiseParallel(output_layouts=between)
        for name in FFN_COLUMN:
            if hasattr(block.ffn, name):
                plan[prefix + "ffn." + name] = ColwiseParallel()
        for name in FFN_ROW:
            if hasattr(block.ffn, name):
                plan[prefix + "ffn." + name] = RowwiseParallel(output_layouts=between)
    if getattr(model, "norm", None) is not None and sp:
        plan["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        logits = Shard(-1) if loss_parallel else Replicate()  # each rank's vocab/tp of them, or all
        plan["output"] = ColwiseParallel(input_layouts=between, output_layouts=logits,
                                         use_local_output=not loss_parallel)
    return plan


def pair_plan(model: Any) -> dict[str, Any]:
    """Consecutive Linear layers, in module order, split as (column, row) pairs: between the two, each rank holds
    out_features/tp of the hidden units, and the row-wise layer's all-reduce makes its output whole again.
    Raises ValueError where no pair exists (nothing for tensor parallel to split)."""
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    plan: dict[str, Any] = {}
    i = 0
    while i + 1 < len(linears):
        (a, la), (b, lb) = linears[i], linears[i + 1]
        if la.out_features == lb.in_features:
            plan[a], plan[b] = ColwiseParallel(), RowwiseParallel()
            i += 2
        else:
            i += 1
    if not plan:
        raise ValueError(f"{type(model).__name__} has no pair of consecutive Linear layers for tensor parallel "
                         "to split")
    return plan


def _replicate_rest(model: nn.Module, mesh: DeviceMesh) -> None:
    """Each module whose own parameters the plan left as plain tensors is replicated on `mesh`: its inputs enter as
    replicated DTensors and its outputs leave as local tensors, so it computes as before and its parameters join
    the others in one optimizer."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def to_dtensor(_mod: Any, inputs: tuple, device_mesh: Any) -> tuple:
        return tuple(DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                     if _is_plain(x) and x.is_floating_point() else x for x in inputs)

    def to_local(_mod: Any, out: Any, _mesh: Any) -> Any:
        return out.to_local() if isinstance(out, DTensor) else out

    for module in list(model.modules()):
        own = list(module.parameters(recurse=False))
        if own and any(not isinstance(p, DTensor) for p in own):
            distribute_module(module, mesh, input_fn=to_dtensor, output_fn=to_local)


def _is_plain(x: Any) -> bool:
    import torch
    from torch.distributed.tensor import DTensor

    return isinstance(x, torch.Tensor) and not isinstance(x, DTensor)

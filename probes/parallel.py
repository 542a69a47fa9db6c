"""Data-parallel wrapping for measured trials: process group, DDP / ZeRO-1 / FSDP2, and checks.

A trial runs one process per device, started with torchrun's environment variables (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); each calls `init_distributed`, then
`wrap_model` and `make_trial_optimizer`, then steps with `advisor.training.train_step`.
Strategy.zero1 is DDP plus ZeroRedundancyOptimizer; zero2 / zero3 are FSDP2 (`fully_shard`)
keeping / freeing the unsharded parameters between forward and backward.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from advisor.config import OptimizerKind, Precision, Strategy
from advisor.errors import TrialError
from advisor.trial import GLOO_EXIT_PAUSE_S

if TYPE_CHECKING:  # torch loads where used (STYLE.md 10)
    import torch
    from torch import nn

BACKENDS = {"cuda": "nccl", "cpu": "gloo"}


class DistInfo(BaseModel):
    """Where this process sits in the trial's process group."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(ge=0, description="Global rank of this process.")
    world_size: int = Field(ge=1, description="Number of processes in the trial (one per device).")
    local_rank: int = Field(ge=0, description="Rank on this machine = the CUDA device index it uses.")
    backend: Literal["nccl", "gloo"] | None = Field(description="None when world_size is 1: no process group.")


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise TrialError(f"distributed trial: environment variable {name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise TrialError(f"distributed trial: {name}={raw!r} is not an integer") from None


def _read_env() -> DistInfo:
    """DistInfo from torchrun's variables (backend filled in by the caller)."""
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size <= 1:
        return DistInfo(rank=0, world_size=1, local_rank=0, backend=None)
    rank, local_rank = _env_int("RANK"), _env_int("LOCAL_RANK", _env_int("RANK"))
    if not 0 <= rank < world_size:
        raise TrialError(f"distributed trial: RANK={rank} is outside 0..{world_size - 1}")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise TrialError(f"distributed trial: environment variable {name} is not set")
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, backend=None)


def init_distributed(device_type: str, timeout_s: float = 60) -> DistInfo:
    """Join the trial's process group (nccl on cuda, gloo on cpu); rank 0 of 1 when WORLD_SIZE <= 1.

    `timeout_s` (seconds) bounds the rendezvous and every later collective, so a rank that died
    turns into a TrialError in the others instead of a hang.
    """
    import torch
    import torch.distributed as dist

    info = _read_env()
    if info.world_size == 1:
        return info
    if device_type not in BACKENDS:
        raise TrialError(f"distributed trial: device type {device_type!r} has no backend; valid: {', '.join(BACKENDS)}")
    if not dist.is_available():
        raise TrialError("distributed trial: this torch build has no torch.distributed")
    backend = BACKENDS[device_type]
    kwargs = {}
    if device_type == "cuda":
        if info.local_rank >= torch.cuda.device_count():
            raise TrialError(f"distributed trial: LOCAL_RANK={info.local_rank} but {torch.cuda.device_count()} "
                             "CUDA devices")
        torch.cuda.set_device(info.local_rank)
        kwargs["device_id"] = torch.device("cuda", info.local_rank)  # binds NCCL to this device eagerly
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        dist.init_process_group(backend, rank=info.rank, world_size=info.world_size,
                                timeout=timedelta(seconds=timeout_s), **kwargs)
    except (RuntimeError, ValueError, OSError) as exc:  # DistError subclasses RuntimeError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TrialError(f"distributed trial: rank {info.rank}/{info.world_size} could not join {backend} "
                         f"group at {where}: {first}") from exc
    return info.model_copy(update={"backend": backend})


def shutdown_distributed() -> None:
    """Destroy the process group if this process joined one (safe to call when it did not); on gloo,
    then pause GLOO_EXIT_PAUSE_S so its workers finish freeing before the interpreter may shut down."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gloo = dist.get_backend() == "gloo"
        dist.destroy_process_group()
        if gloo:
            time.sleep(GLOO_EXIT_PAUSE_S)


def check_strategy(strategy: Strategy, world_size: int, device_type: str, *, fused_backward: bool = False,
                   optimizer_kind: OptimizerKind | None = None, impl: str | None = None) -> str | None:
    """None if `strategy` can run with `world_size` processes on `device_type`, else why not (one line).

    The caller records a non-None answer as an `invalid` trial rather than launching it. The
    keyword arguments, when given, also check the optimizer knobs against the strategy.
    Checked on CPU/gloo with torch 2.13: ddp, zero1, zero2 and zero3 all train there.
    """
    import torch
    import torch.distributed as dist

    if world_size < 1:
        return f"world size must be >= 1, got {world_size}"
    if strategy == Strategy.single:
        return None if world_size == 1 else f"strategy single runs one process, not {world_size}"
    if world_size < 2:
        return f"strategy {strategy.value} needs at least 2 processes, got {world_size}"
    if device_type not in BACKENDS:
        return f"strategy {strategy.value} runs on cuda (nccl) or cpu (gloo), not {device_type!r}"
    if not dist.is_available():
        return "this torch build has no torch.distributed"
    if device_type == "cuda":
        if not dist.is_nccl_available():
            return "this torch build has no NCCL backend"
        if world_size > torch.cuda.device_count():
            return (f"{world_size} processes need {world_size} CUDA devices; this machine has "
                    f"{torch.cuda.device_count()}")
    if fused_backward:
        # The step in the post-accumulate-grad hook would run on this rank's own gradient,
        # before DDP's all-reduce / FSDP's reduce-scatter: ranks would silently diverge.
        return (f"an optimizer step fused into backward cannot run under {strategy.value}: it steps before "
                "gradients are reduced")
    return _check_fsdp_optimizer(strategy, optimizer_kind, impl)


def _check_fsdp_optimizer(strategy: Strategy, optimizer_kind: OptimizerKind | None, impl: str | None) -> str | None:
    """FSDP2 steps DTensor shards: torch 2.13 has DTensor rules for the foreach kernels and for
    fused Adam/AdamW, but none for fused SGD (aten._fused_sgd_ raises NotImplementedError)."""
    sgd = (OptimizerKind.sgd, OptimizerKind.sgd_momentum)
    if strategy in (Strategy.zero2, Strategy.zero3) and impl == "fused" and optimizer_kind in sgd:
        return (f"fused {optimizer_kind.value} has no DTensor support in torch 2.13, so it cannot step "
                f"{strategy.value} (FSDP2) shards")
    return None


def _broadcast_from_rank0(model: nn.Module) -> None:
    """Copy rank 0's parameters and buffers to every rank (ranks may have built different inits).

    DDP does this itself at construction; FSDP2 shards each rank's own tensors as they are.
    """
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


def _fully_shard(model: nn.Module, strategy: Strategy, info: DistInfo, device_type: str) -> nn.Module:
    """FSDP2 on each repeated block, then the root (bottom-up, as fully_shard requires).

    zero2 keeps the unsharded parameters from forward to backward (reshard_after_forward=False:
    gradients and optimizer state sharded, parameters whole during the step's compute); zero3
    frees them after forward and all-gathers again in backward.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from advisor.training import repeated_blocks

    mesh = init_device_mesh(device_type, (info.world_size,))
    reshard = strategy == Strategy.zero3
    # No FSDP casting: bf16/fp16 trials use autocast over fp32 parameters (autocast casts per op),
    # bf16-pure parameters are already bf16 (cast in wrap_model), fp32/tf32 stay fp32.
    policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None)
    _broadcast_from_rank0(model)
    for block in repeated_blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    return model


def wrap_model(model: nn.Module, strategy: Strategy, info: DistInfo, *, precision: Precision,
               device_type: str) -> nn.Module:
    """The model as `strategy` trains it: itself (single), DDP (ddp, zero1) or FSDP2 (zero2, zero3).

    Wrap before `advisor.training.prepare` and build the optimizer after: DDP and FSDP2 replace
    or shard the parameters an optimizer would otherwise hold.
    """
    import torch

    reason = check_strategy(strategy, info.world_size, device_type)
    if reason is not None:
        raise TrialError(f"cannot wrap the model: {reason}")
    if strategy == Strategy.single:
        return model
    if precision == Precision.bf16_pure:
        # DDP sizes its gradient buckets and FSDP2 its shards from the dtype at wrap time, so the
        # cast `prepare` would do later must happen first (prepare's own cast is then a no-op).
        model.to(torch.bfloat16)
    if device_type == "cuda":
        model.to(torch.device("cuda", info.local_rank))
    if strategy in (Strategy.ddp, Strategy.zero1):
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [info.local_rank] if device_type == "cuda" else None  # None: CPU module
        return DistributedDataParallel(model, device_ids=device_ids)
    return _fully_shard(model, strategy, info, device_type)


def make_trial_optimizer(model: nn.Module, strategy: Strategy, optimizer_kind: OptimizerKind,
                         impl: str | None, info: DistInfo) -> torch.optim.Optimizer:
    """The optimizer over a wrapped model's parameters; ZeRO-1 shards its state across ranks.

    zero1: ZeroRedundancyOptimizer around the class and keywords `make_optimizer` uses, so each
    rank keeps state (and steps) only for its partition and then broadcasts its parameters.
    zero2 / zero3: the ordinary optimizer over FSDP2's DTensor shards, which steps each
    rank's shard locally. `impl` is used as asked, never swapped for another (a knob that
    cannot apply is refused, docs/design.md). On CPU/gloo with torch 2.13 (unchecked on CUDA):
    on DTensor shards torch's default, for-loop, foreach and fused Adam/AdamW all step; fused
    SGD has no DTensor rule, so it raises TrialError (`check_strategy` says so up front).
    Adagrad has no fused kernel, so `make_optimizer` runs it with torch's default.
    """
    from advisor.training import make_optimizer, optimizer_spec

    reason = _check_fsdp_optimizer(strategy, optimizer_kind, impl)
    if reason is not None:
        raise TrialError(f"cannot build the optimizer: {reason}")
    params = [p for p in model.parameters() if p.requires_grad]
    if strategy == Strategy.zero1 and info.world_size > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        cls, kwargs = optimizer_spec(optimizer_kind, impl)
        return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)
    return make_optimizer(optimizer_kind, params, impl)


def _unwrap(model: nn.Module) -> nn.Module:
    """The module under DDP, so names (no 'module.' prefix) match the unwrapped model's."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: an FSDP2 DTensor shard is all-gathered (a collective: every rank calls)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `tensor`: its local shard for a DTensor, else the tensor."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def gathered_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of every parameter, whole (FSDP2 shards all-gathered: every rank must call).

    Names are the unwrapped model's (no DDP 'module.' prefix), in `named_parameters` order.
    A copy, not a view: later steps do not change what was returned.
    """
    return {name: _full(param.detach()).to("cpu", copy=True) for name, param in _unwrap(model).named_parameters()}


def param_digest(model: nn.Module) -> str:
    """SHA-256 over every parameter's name, dtype, shape and full (gathered) values, in order.

    Equal on two ranks iff they hold the same model; equal to the unwrapped model's digest
    before any step. Under FSDP2 this all-gathers, so every rank must call it together.
    """
    import torch

    digest = hashlib.sha256()
    for name, full in gathered_parameters(model).items():
        full = full.contiguous()
        digest.update(f"{name}|{full.dtype}|{tuple(full.shape)}|".encode())
        digest.update(full.reshape(-1).view(torch.uint8).numpy().tobytes())  # raw bytes: bf16 too
    return digest.hexdigest()


def local_param_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds: its shards under FSDP2 (between steps), all else."""
    return sum(_local(p).numel() * p.element_size() for p in model.parameters())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state tensors this rank holds (ZeRO-1: its partition; FSDP2: its shards)."""
    import torch

    # Looked up, not imported: importing torch.distributed.optim TorchScript-compiles its
    # functional optimizers (seconds); if it was never imported, this cannot be a ZeRO optimizer.
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    is_zero = zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer)
    inner = optimizer.optim if is_zero else optimizer
    total = 0
    for state in inner.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += _local(value).numel() * value.element_size()
    return total


def make_grad_scaler(strategy: Strategy, device_type: str):
    """The fp16 loss scaler for `strategy`: replace `prepare`'s scaler with it in a trial.

    Under FSDP2 each rank checks only its gradient shard for inf/NaN; ShardedGradScaler
    all-reduces that flag so every rank skips (or takes) the same steps. DDP and ZeRO-1
    gradients are already all-reduced, so the ordinary GradScaler agrees on every rank.
    """
    import torch

    if strategy in (Strategy.zero2, Strategy.zero3):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device_type)
    return torch.amp.GradScaler(device_type)

"""The training step the advisor runs and traces: optimizer, precision, checkpointing, fused step.

The estimator traces exactly this code under fake tensors and the measured runs execute it for
real, so what is predicted and what is measured come from one definition of a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from advisor.config import Checkpointing, OptimizerKind, Precision

LEARNING_RATE = 1e-3


class RowWiseAdagrad(torch.optim.Optimizer):
    """Adagrad whose squared-gradient accumulator keeps one value per row of 2-D tables.

    As FBGEMM's row-wise Adagrad for embedding tables: state is (rows,) fp32 instead of the
    table's full shape, so a 1e9 x 128 table keeps 4 GB of state instead of 512 GB. Tensors that
    are not 2-D (biases, norms) keep the ordinary element-wise accumulator.
    """

    def __init__(self, params, lr: float = 1e-2, eps: float = 1e-10):
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch.optim contract
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if "sum" not in state:
                    # zeros_like keeps a DTensor shard (FSDP2) a DTensor: (rows,) or p's shape, fp32.
                    like = p[:, 0] if p.dim() == 2 else p
                    state["sum"] = torch.zeros_like(like, dtype=torch.float32, memory_format=torch.contiguous_format)
                acc = state["sum"]
                if p.dim() == 2:
                    acc.add_(grad.float().pow(2).mean(dim=1))
                    denom = acc.sqrt().add_(group["eps"]).unsqueeze(1)
                else:
                    acc.addcmul_(grad.float(), grad.float())
                    denom = acc.sqrt().add_(group["eps"])
                p.addcdiv_(grad, denom.to(p.dtype), value=-group["lr"])
        return None


def optimizer_spec(kind: OptimizerKind, impl: str | None = None) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The optimizer class for `kind` and its constructor keywords (lr, momentum, foreach/fused).

    Split from `make_optimizer` so a wrapper that constructs the optimizer itself (ZeRO-1's
    ZeroRedundancyOptimizer takes a class and keywords) gets the same hyper-parameters.
    impl is None (torch's default), 'for-loop', 'foreach' or 'fused'.
    """
    kw: dict[str, Any] = {}
    if impl == "for-loop":
        kw["foreach"] = False
    elif impl == "foreach":
        kw["foreach"] = True
    elif impl == "fused":
        kw["fused"] = True
    if kind == OptimizerKind.sgd:
        return torch.optim.SGD, {"lr": LEARNING_RATE, **kw}
    if kind == OptimizerKind.sgd_momentum:
        return torch.optim.SGD, {"lr": LEARNING_RATE, "momentum": 0.9, **kw}
    if kind == OptimizerKind.adam:
        return torch.optim.Adam, {"lr": LEARNING_RATE, **kw}
    if kind == OptimizerKind.adamw:
        return torch.optim.AdamW, {"lr": LEARNING_RATE, **kw}
    if kind == OptimizerKind.adagrad:
        return torch.optim.Adagrad, {"lr": LEARNING_RATE, **{k: v for k, v in kw.items() if k != "fused"}}
    return RowWiseAdagrad, {"lr": LEARNING_RATE}


def make_optimizer(kind: OptimizerKind, params, impl: str | None = None) -> torch.optim.Optimizer:
    """One optimizer of `kind`; impl is None (torch's default), 'for-loop', 'foreach' or 'fused'."""
    cls, kw = optimizer_spec(kind, impl)
    return cls(params, **kw)


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the longest ModuleList/Sequential whose children share a class.

    These are the units that activation checkpointing wraps and FSDP shards one at a time.
    """
    best: list[nn.Module] = []
    for mod in model.modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)):
            kids = list(mod.children())
            if len(kids) >= 2 and len({type(k) for k in kids}) == 1 and len(kids) > len(best):
                if any(True for _ in kids[0].parameters()):
                    best = kids
    return best


def apply_activation_checkpointing(model: nn.Module, mode: Checkpointing | bool = Checkpointing.full) -> int:
    """Wrap each repeated block for `mode` (a Checkpointing, or its boolean form); returns the blocks wrapped.

    full: the block's forward recomputed in backward (non-reentrant checkpoint), only its inputs held.
    selective: Megatron's selective recompute (Korthikanti et al. 2022, sec. 5): each attention core, a
    `scaled_dot_product_attention` call made by the block, runs in a non-reentrant checkpoint of its own; the
    rest of the block saves what it saves without checkpointing. none: nothing wrapped (0).
    """
    mode = Checkpointing(mode)
    if not mode:
        return 0
    blocks = repeated_blocks(model)
    for block in blocks:
        block.forward = (_checkpointed if mode == Checkpointing.full else _attention_recomputed)(block.forward)
    return len(blocks)


def _checkpointed(inner: Callable[..., Any]) -> Callable[..., Any]:
    from torch.utils.checkpoint import checkpoint

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    return forward


def _attention_recomputed(inner: Callable[..., Any]) -> Callable[..., Any]:
    def forward(*args, **kwargs):
        with _AttentionRecompute():
            return inner(*args, **kwargs)

    return forward


class _AttentionRecompute(torch.overrides.TorchFunctionMode):
    """Runs each scaled_dot_product_attention call in a non-reentrant checkpoint, under the SDPA backends chosen
    at the call (a model's `sdpa_kernel` context is gone when backward recomputes it).

    A function-level checkpoint rather than torch's selective-checkpoint contexts (CheckpointPolicy): those hold
    the output of every op they do not recompute, also the outputs backward never reads (the residual adds, wo's
    and the FFN's output, RoPE's and RMSNorm's intermediates), which costs more than no checkpointing at all;
    and at the aten level the math backend's score matmul, which precedes its softmax, would be held too.
    Every backend (math, flash, memory-efficient, cuDNN, the CPU's flash) runs inside the call, so all are
    recomputed. Attention written as matmul and softmax without SDPA is not recognised and stays saved.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention or not torch.is_grad_enabled():
            return func(*args, **kwargs)
        from torch.nn.attention import _cur_sdpa_kernel_backends, sdpa_kernel
        from torch.utils.checkpoint import checkpoint

        if torch.compiler.is_compiling():  # the compiled backward recomputes the kernel traced in forward
            return checkpoint(func, *args, use_reentrant=False, **kwargs)
        backends = _cur_sdpa_kernel_backends(with_priority=True)

        def core(*a, **kw):
            with sdpa_kernel(backends, set_priority=True):
                return func(*a, **kw)

        return checkpoint(core, *args, use_reentrant=False, **kwargs)


@dataclass
class StepContext:
    """Everything a training step needs, built once per run by `prepare`."""

    model: nn.Module
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    precision: Precision
    device_type: str
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    fused_backward: bool = False
    scaler: Any = None
    fake_scaler: bool = False  # under fake tensors: scale/unscale with no inf check (.item())


def _attach_fused_backward(model: nn.Module, kind: OptimizerKind, impl: str | None) -> list[torch.optim.Optimizer]:
    """A per-parameter optimizer stepped in each parameter's post-accumulate-grad hook.

    The gradient is freed right after its step, so at most a few gradients are alive at once
    (the torch tutorial "How to save memory by fusing the optimizer step into the backward pass").
    """
    optimizers = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        opt = make_optimizer(kind, [p], impl)
        optimizers.append(opt)

        def hook(param, _opt=opt):
            _opt.step()
            param.grad = None

        p.register_post_accumulate_grad_hook(hook)
    return optimizers


def prepare(model: nn.Module, loss_fn, *, precision: Precision, optimizer: OptimizerKind, device_type: str = "cpu",
            optimizer_impl: str | None = None, checkpointing: Checkpointing | bool = Checkpointing.none,
            fused_backward: bool = False, fake: bool = False, wrap: Callable[[nn.Module], nn.Module] | None = None,
            make_opt: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
            compile_fn: Callable[[nn.Module], nn.Module] | None = None) -> StepContext:
    """Cast, wrap and attach an optimizer to a built model; returns the context `train_step` uses.

    Order matters and is fixed here: cast (pure bf16), checkpoint the blocks (`checkpointing`, a Checkpointing or
    its boolean form: apply_activation_checkpointing), `wrap` (DDP/FSDP: parameters may become sharded DTensors),
    build the optimizer over the wrapped parameters
    (`make_opt`, e.g. a sharded one; default `make_optimizer`), then `compile_fn` the module.
    """
    if precision == Precision.bf16_pure:
        model.to(torch.bfloat16)
    if checkpointing:
        apply_activation_checkpointing(model, checkpointing)
    if wrap is not None:
        model = wrap(model)
    ctx = StepContext(model=model, loss_fn=loss_fn, precision=precision, device_type=device_type,
                      fused_backward=fused_backward)
    if fused_backward:
        ctx.optimizers = _attach_fused_backward(model, optimizer, optimizer_impl)
    elif make_opt is not None:
        ctx.optimizers = [make_opt(model)]
    else:
        ctx.optimizers = [make_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad], optimizer_impl)]
    if compile_fn is not None:
        ctx.model = compile_fn(model)
    if precision == Precision.fp16:
        if fake:
            ctx.fake_scaler = True
        else:
            ctx.scaler = torch.amp.GradScaler(device_type)
    return ctx


def _floats_to(batch: Any, dtype: torch.dtype) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, batch)


def train_step(ctx: StepContext, batch: Any, phase: Callable[[str], None] | None = None, *,
               loss_scale: float = 1.0, step: bool = True,
               before_backward: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """forward (under autocast where asked), backward, optimizer step, zero_grad(set_to_none).

    `phase`, when given, is told 'forward', 'backward', 'step' and 'done' as the step moves on
    (the estimator's tracer uses it to label what each allocation is for); `before_backward` is
    handed the tensor that backward() is called on (the tracer watches its graph). Gradient
    accumulation: `loss_scale` = 1/micro-batches and `step=False` on all but the last one.
    """
    phase = phase or (lambda _name: None)
    phase("forward")
    if ctx.precision == Precision.bf16_pure:  # bf16 weights take bf16 inputs: cast the float tensors
        batch = _floats_to(batch, torch.bfloat16)
    dtype = ctx.precision.autocast_dtype
    if dtype is not None:
        with torch.autocast(ctx.device_type, dtype=dtype):
            loss = ctx.loss_fn(ctx.model, batch)
    else:
        loss = ctx.loss_fn(ctx.model, batch)
    if loss_scale != 1.0:
        loss = loss * loss_scale
    if step:
        phase("backward")
    if ctx.scaler is not None:
        target = ctx.scaler.scale(loss)
    elif ctx.fake_scaler and step:
        target = loss * 65536.0
    else:
        target = loss
    if before_backward is not None:
        before_backward(target)
    target.backward()
    del target
    if not step:
        return loss.detach()
    phase("step")
    if not ctx.fused_backward:
        if ctx.scaler is not None:
            ctx.scaler.step(ctx.optimizers[0])
        elif ctx.fake_scaler:
            with torch.no_grad():
                for p in ctx.model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(1.0 / 65536.0)
            ctx.optimizers[0].step()
        else:
            ctx.optimizers[0].step()
    if ctx.scaler is not None:
        ctx.scaler.update()
    if not ctx.fused_backward:
        ctx.optimizers[0].zero_grad(set_to_none=True)
    phase("done")
    return loss.detach()


def set_matmul_precision(precision: Precision) -> None:
    """tf32 is a global switch in torch: on for 'tf32', off (full fp32) otherwise."""
    torch.backends.cuda.matmul.allow_tf32 = precision == Precision.tf32
    torch.backends.cudnn.allow_tf32 = precision == Precision.tf32

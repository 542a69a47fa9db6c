"""Gradient accumulation in a rank's program: a step's micro-steps add into the same gradients, and the
data-parallel reduction waits for the last of them (DDP's no_sync, FSDP2's requires_gradient_sync). Under ZeRO-2
the gathered parameters also stay gathered from one micro-step to the next, so a step gathers each unit once, as
Megatron-LM's distributed optimizer does. A pipeline
schedule reduces and scales its stages' gradients at the end of every schedule.step(); on the other micro-steps
that is held back here, so the last one reduces and scales the sum."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator


@contextmanager
def gradient_sync(model: Any, enabled: bool, *, keep_gathered: bool = False) -> Iterator[None]:
    """Skip the gradient reduction on non-final micro-batches (DDP no_sync, FSDP2's switch). `keep_gathered`
    (FSDP2 that keeps its parameters gathered from forward to backward: ZeRO-2): a non-final micro-batch's backward
    leaves them gathered too, for the next micro-batch's forward; the last one's reshards them."""
    inner = getattr(model, "_orig_mod", model)  # under torch.compile
    if enabled:
        yield
    elif hasattr(inner, "no_sync"):
        with inner.no_sync():
            yield
    elif hasattr(inner, "set_requires_gradient_sync"):
        inner.set_requires_gradient_sync(False)
        if keep_gathered:
            inner.set_reshard_after_backward(False)
        try:
            yield
        finally:
            inner.set_requires_gradient_sync(True)
            if keep_gathered:
                inner.set_reshard_after_backward(True)
    else:
        yield


@contextmanager
def pipeline_accumulation(schedule: Any, loss_scale: float, sync: bool) -> Iterator[None]:
    """Around one `schedule.step()` (torch.distributed.pipelining): every micro-batch's loss times `loss_scale`;
    without `sync`, each stage's end-of-step reduction keeps its gradients (`_held_reduction`), and a DDP stage
    runs its module bare (the schedule all-reduces a DDP stage's last backward whatever no_sync says; the module
    shares its parameters, so their gradients accumulate for the last micro-step's all-reduce). With loss_scale 1
    and sync it changes nothing."""
    from torch.nn.parallel import DistributedDataParallel

    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    loss_fn = schedule._loss_fn
    wrapped = {}
    if loss_scale != 1.0:
        schedule._loss_fn = lambda output, target, **kw: loss_fn(output, target, **kw) * loss_scale
    if not sync:
        for stage in stages:
            stage.perform_reduce_grad = _held_reduction(stage)
            if isinstance(stage.submod, DistributedDataParallel):
                wrapped[stage], stage.submod = stage.submod, stage.submod.module
    try:
        yield
    finally:
        schedule._loss_fn = loss_fn
        for stage in stages:
            stage.__dict__.pop("perform_reduce_grad", None)  # the class's method again
        for stage, ddp in wrapped.items():
            stage.submod = ddp


def _held_reduction(stage: Any) -> Any:
    """`stage.perform_reduce_grad` for a micro-step that does not step the optimizer: an FSDP2 stage runs it with
    its gradient sync off, so its units accumulate their unsharded gradients and reshard their parameters, as
    the schedule leaves them between steps; nothing is scaled (the last micro-step scales the sum by the
    micro-batch count). A stage without FSDP has nothing to reduce."""
    from torch.distributed.fsdp import FSDPModule

    reduce = type(stage).perform_reduce_grad

    def held(_grad_scale_factor: int) -> None:
        module = stage.submod
        if not isinstance(module, FSDPModule):
            return
        sync = module.set_requires_gradient_sync
        module.set_requires_gradient_sync = lambda _requires, **kw: sync(False, **kw)
        try:
            reduce(stage, 1)
        finally:
            del module.set_requires_gradient_sync

    return held


def accumulated_steps(grad_accum: int) -> list[tuple[dict[str, Any], int]]:
    """The micro-steps that stand for one optimizer step of `grad_accum` batches, each as (the keyword arguments of
    a program's `step`, how many of the step's batches it stands for): one plain step; or a micro-step that only
    accumulates, then (from 3 batches) one of the middle ones, which hold the first's gradients (and under ZeRO-2
    its gathered parameters), then the last, which steps. The peak falls on the last; the step's collectives are
    the sum."""
    if grad_accum == 1:
        return [({}, 1)]
    scale = 1.0 / grad_accum
    accumulate, last = {"loss_scale": scale, "optimizer_step": False}, {"loss_scale": scale, "optimizer_step": True}
    return [(accumulate, 1)] + ([(accumulate, grad_accum - 2)] if grad_accum > 2 else []) + [(last, 1)]

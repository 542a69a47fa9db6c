"""Memory an op's kernel holds that no fake op shows (workspaces, scratch): one rule per kind of op, and the
ordered registry the trace's dispatch mode asks for the first rule that applies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from advisor.estimate import scratch_cpu, scratch_cuda
from advisor.estimate.kernel_probe import may_copy_strided

if TYPE_CHECKING:
    from advisor.estimate.trace import Tracker


@dataclass(frozen=True)
class ScratchRule:
    """How the trace records what one kind of op's kernel holds beyond its outputs.

    `active(tracker)`: whether the trace's target calls for the rule (asked once per trace);
    `applies(tracker, func, args, kwargs)`: whether the op is one of its kind;
    `apply(tracker, func, args, kwargs, out)`: records it and returns the op's outputs (a workspace of the real
    size may replace the fake one)."""

    name: str
    active: Callable[[Tracker], bool]
    applies: Callable[[Tracker, Any, tuple, dict], bool]
    apply: Callable[[Tracker, Any, tuple, dict, Any], Any]


def _always(tracker: Tracker) -> bool:
    return True


def _this_cpu(tracker: Tracker) -> bool:  # this CPU is the target: kernels probed here
    return tracker.cpu_workspaces


def _this_gpu(tracker: Tracker) -> bool:  # this machine's GPU is the target: kernels probed on it
    return tracker.cuda_workspaces


def _remote_gpu(tracker: Tracker) -> bool:  # a CUDA target not at hand: its reductions' scratch from torch's rules
    return tracker.reduce_gpu is not None


def _probe(kind: str | None) -> Callable[[Tracker, Any, tuple, dict, Any], Any]:
    def apply(tracker: Tracker, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        return scratch_cpu.real_scratch(tracker, func, args, kwargs, out, kind=kind)

    return apply


# In order: an op is recorded by the first active rule that applies to it.
RULES: tuple[ScratchRule, ...] = (
    ScratchRule("oneDNN's RNN workspace", _always, scratch_cpu.is_rnn_layer, scratch_cpu.rnn_workspace),
    ScratchRule("cuDNN's LSTM backward workspace", _this_gpu, scratch_cuda.is_rnn_layer_backward,
                scratch_cuda.rnn_backward_scratch),
    ScratchRule("oneDNN's scratch", _this_cpu, scratch_cpu.is_onednn_scratch_op, _probe(None)),
    ScratchRule("a 16-bit matrix product's scratch", _this_cpu, scratch_cpu.is_half_product, _probe("product")),
    ScratchRule("a reduction's scratch", _this_cpu, scratch_cpu.is_cpu_reduction, _probe("reduction")),
    ScratchRule("a strided input's copy", _this_cpu, may_copy_strided, _probe("copy")),
    ScratchRule("a sparse op's scratch", _this_cpu, scratch_cpu.is_sparse_op, _probe(None)),
    ScratchRule("a CUDA kernel's scratch", _this_gpu, scratch_cuda.is_cuda_scratch_op, scratch_cuda.cuda_scratch),
    ScratchRule("a strided input's copy on the GPU", _this_gpu, may_copy_strided, scratch_cuda.strided_copy_scratch),
    ScratchRule("a reduction's scratch on a GPU not at hand", _remote_gpu, scratch_cuda.is_remote_reduction,
                scratch_cuda.reduction_scratch),
    ScratchRule("cuDNN's workspace on a GPU not at hand", _remote_gpu, scratch_cuda.is_cudnn_op,
                scratch_cuda.note_unsized_cudnn),
)


def active_rules(tracker: Tracker) -> tuple[ScratchRule, ...]:
    """The rules the trace's target calls for, in RULES' order."""
    return tuple(rule for rule in RULES if rule.active(tracker))


def rule_for(rules: tuple[ScratchRule, ...], tracker: Tracker, func: Any, args: tuple,
             kwargs: dict) -> ScratchRule | None:
    """The first of `rules` that applies to the op, or None."""
    for rule in rules:
        if rule.applies(tracker, func, args, kwargs):
            return rule
    return None

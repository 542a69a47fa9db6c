"""Where an op traced on fake tensors, or under a dispatch mode, differs from the real step, and the trace's
correction: CTC loss, outputs the kernel aliases, and autograd's in-place accumulation."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from advisor.errors import EstimateError

if TYPE_CHECKING:
    from advisor.estimate.trace import Tracker


def ctc_fake(tracker: Tracker, func: Any, args: tuple) -> Any:
    """CTC loss on fake tensors, which refuse it (its shape needs the target lengths' values). Allocates what
    ATen's kernels do (LossCTC.cpp and .cu): forward, the per-sample loss and log_alpha (N, T, 2 x S + 1);
    backward, the gradient like log_probs, then log_beta like log_alpha while it runs. S is the longest target
    the lengths allow: their largest where given as ints, else the padded targets' width (N, S), or for
    concatenated 1-D targets their count capped at T (a longer target has no alignment); such a call counts
    in `tracker.ctc_bounded`. Raises EstimateError for log_probs that are not 3-D."""
    backward = "backward" in func.name()
    log_probs, targets, _, lengths = args[1:5] if backward else args[:4]  # backward's first is the loss's grad
    if log_probs.dim() != 3:
        raise EstimateError(f"cannot trace ctc_loss on log_probs of {log_probs.dim()} dims on fake tensors")
    frames, batch = log_probs.shape[0], log_probs.shape[1]
    if isinstance(lengths, (list, tuple)):
        longest = max((int(n) for n in lengths), default=0)
    else:
        longest = targets.shape[1] if targets.dim() == 2 else min(targets.numel(), frames)
        tracker.ctc_bounded += 1
    if not backward:
        return (log_probs.new_empty((batch,)), log_probs.new_empty((batch, frames, 2 * longest + 1)))
    grad = log_probs.new_empty(log_probs.shape)
    tracker.track(grad)
    tracker.scratch(batch * frames * (2 * longest + 1) * log_probs.element_size())  # log_beta
    return grad


# op -> for each of its outputs, the index of the first output sharing its storage: ops whose kernel returns one
# tensor in two places (mkldnn_rnn_layer_backward's two bias gradients), seen where FakeTensorMode ran the kernel
_OUTPUT_ALIASES: dict[Any, tuple[int, ...]] = {}


def aliased_as_the_kernel(func: Any, out: tuple) -> tuple:
    """`out` with the outputs the kernel returns as one tensor made one tensor again. FakeTensorMode's dispatch
    cache rebuilds a cached op's outputs as separate tensors, where the kernel (run on a cache miss) returns one
    tensor twice and autograd then clones it for one of the two gradients it feeds. Without this, whether an op's
    shapes had run before in the process would change the trace, and two batch sizes' traces would not match
    allocation by allocation (batchmodel.py)."""
    import torch

    keys = [t.untyped_storage()._cdata if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.numel()
            else None for t in out]
    first = tuple(keys.index(k) if k is not None else i for i, k in enumerate(keys))
    if first != tuple(range(len(out))):
        _OUTPUT_ALIASES[func] = first
        return out
    seen = _OUTPUT_ALIASES.get(func)
    if seen is None or len(seen) != len(out):
        return out
    return tuple(out[j] for j in seen)


def _non_overlapping_and_dense(t: Any) -> bool:
    """Whether `t`'s elements fill its memory exactly once in some order of its dimensions."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def accumulates_in_place(args: tuple) -> bool:
    """Whether the real autograd engine adds a gradient into the one already buffered in place.

    Two gradients for one input of a node (a tensor used twice: tied embeddings, a residual fork) are summed in
    that node's input buffer. With no grad mode and the buffered gradient `args[0]` a plain dense tensor whose
    memory nothing else holds, the engine adds in place (torch/csrc/autograd/input_buffer.cpp,
    `can_accumulate_inplace`); under any Python dispatch mode, such as the tracer's and FakeTensorMode, it counts
    every tensor as a subclass and adds out of place, allocating a third gradient the real step never has. A
    second reference to the same tensor (one gradient sent to two places), which the engine also refuses, is not
    seen here: the buffered gradient is taken as its only holder.
    """
    import torch

    old, new = args[0], args[1]
    if torch.is_grad_enabled() or old is new or old._is_view() or tuple(old.shape) != tuple(new.shape):
        return False
    if old.dtype != new.dtype or old.is_sparse or not _non_overlapping_and_dense(old):
        return False
    st = old.untyped_storage()
    # st's own Python object holds one reference, the tensor another: more is another tensor on it
    return torch._C._storage_Use_Count(st._cdata) == 2


def coo_bytes(t: Any, entries: int) -> tuple[int, int]:
    """The bytes of sparse COO `t`'s index and value tensors were they to hold `entries` entries."""
    values = t._values()
    return (t.sparse_dim() * entries * t._indices().element_size(),
            entries * math.prod(values.shape[1:]) * values.element_size())


def sparse_parts(t: Any) -> list[Any]:
    """The dense tensors that hold a sparse tensor's memory: COO's indices and values; a compressed layout's
    (CSR, CSC, BSR, BSC) row or column pointers, its indices and values. A graph network's adjacency is
    commonly one (torch.sparse.mm), and its size is theirs."""
    import torch

    if t.layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values()]
    return []

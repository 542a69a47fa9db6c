"""Bytes each rank hands to collectives and point-to-point sends, by kind, counted at the dispatcher.

Every collective reaches the dispatcher as a c10d op (process-group calls, DDP's reducer, FSDP2) or a functional
collective (DTensor's redistributions), so one dispatch mode sees them all, on real ranks and under a fake process
group alike. A kind's bytes are its payload on this rank: the all-reduced buffer; the gathered output of an
all-gather; the input a reduce-scatter reduces; a send's or receive's tensor; an all-to-all's input (context
parallel's ring rotation is one that sends all of it to the next rank). Ring algorithms move 2(n-1)/n
(all-reduce) or (n-1)/n (the others) of that over the wire.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Any, Iterator

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send", "recv", "broadcast", "all_to_all")

# op name (namespace.name, no overload) -> (kind, how its payload is read off the arguments)
#   "all": every tensor argument; "first": the first argument (a tensor or a list of them);
#   "second": the second; "gathered": the input times the group size (functional all-gather)
_OPS: dict[str, tuple[str, str]] = {
    "c10d.allreduce_": ("all_reduce", "first"),
    "c10d.allreduce_coalesced_": ("all_reduce", "first"),
    "_c10d_functional.all_reduce": ("all_reduce", "first"),
    "_c10d_functional.all_reduce_": ("all_reduce", "first"),
    "_c10d_functional.all_reduce_coalesced": ("all_reduce", "first"),
    "c10d._allgather_base_": ("all_gather", "first"),
    "c10d.allgather_": ("all_gather", "first"),
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", "first"),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", "gathered"),
    "_c10d_functional.all_gather_into_tensor_out": ("all_gather", "gathered"),
    "_c10d_functional.all_gather_into_tensor_coalesced": ("all_gather", "gathered"),
    "c10d._reduce_scatter_base_": ("reduce_scatter", "second"),
    "c10d.reduce_scatter_": ("reduce_scatter", "second"),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", "second"),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", "first"),
    "_c10d_functional.reduce_scatter_tensor_coalesced": ("reduce_scatter", "first"),
    "c10d.send": ("send", "first"),
    "c10d.recv_": ("recv", "first"),
    "c10d.recv_any_source_": ("recv", "first"),
    "c10d.broadcast_": ("broadcast", "first"),
    "_c10d_functional.broadcast": ("broadcast", "first"),
    "c10d.alltoall_base_": ("all_to_all", "second"),
    "_c10d_functional.all_to_all_single": ("all_to_all", "first"),
}


def _bytes(value: Any) -> int:
    import torch
    from torch.utils._pytree import tree_flatten

    return sum(_local_bytes(t) for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


def _local_bytes(t: Any) -> int:
    local = getattr(t, "_local_tensor", t)  # a DTensor's bytes on this rank
    return local.numel() * local.element_size()


def payload(name: str, args: tuple, kwargs: dict) -> tuple[str, int] | None:
    """(kind, bytes) of a call to the op `name` (namespace.name), or None where it moves nothing."""
    entry = _OPS.get(name)
    if entry is None:
        return None
    kind, rule = entry
    if rule == "first":
        return kind, _bytes(args[0]) if args else 0
    if rule == "second":
        return kind, _bytes(args[1]) if len(args) > 1 else 0
    group_size = next((a for a in args[1:] if isinstance(a, int)), 1)  # (input, group_size, group_name)
    return kind, _bytes(args[0]) * group_size


def op_name(func: Any) -> str:
    return f"{func.namespace}.{func._opname}"


class CommCounter:
    """Counts, by kind, the payload bytes of every collective this thread's ops start while `mode()` is active.

    `bytes` accumulates over its life; `reset()` between steps. The mode also sees the autograd engine's work,
    which inherits the dispatch-mode stack on CPU backward.
    """

    def __init__(self) -> None:
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def record(self, func: Any, args: tuple, kwargs: dict | None) -> tuple[str, int] | None:
        """Count `func` if it is a collective (called from a dispatch mode, the estimator's tracer included); its
        (kind, payload bytes), or None."""
        if func.namespace not in ("c10d", "_c10d_functional"):
            return None
        hit = payload(op_name(func), args, kwargs or {})
        if hit is not None:
            self.bytes[hit[0]] += hit[1]
            self.calls[hit[0]] += 1
        return hit

    def mode(self):
        """A dispatch mode that counts and runs each op unchanged."""
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Counting(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
                counter.record(func, args, kwargs)
                return func(*args, **(kwargs or {}))

        return Counting()

    @contextmanager
    def counting(self) -> Iterator[None]:
        """`mode()` entered, and entered again inside DTensor's dispatch where loss_parallel computes a decoder's
        loss from sharded logits (tensor.loss_ops_under), whose all-reduces it would not see otherwise."""
        from advisor.parallel.tensor import loss_ops_under

        mode = self.mode()
        with mode, loss_ops_under(mode):
            yield

    def per_step(self, steps: int) -> dict[str, int]:
        """Bytes per kind divided by `steps` (rounded), the kinds with none left out."""
        return {k: round(v / max(steps, 1)) for k, v in sorted(self.bytes.items()) if v}


class GlooStaging(CommCounter):
    """A CommCounter that also records, through `scratch` (Tracker.scratch: blocks held while an op runs), the
    tensors gloo makes through torch's allocator on the calling thread as a collective is called (a CPU target's
    ranks): a scatter's root flattens its scatter list into a new tensor of the same bytes as it enqueues the work
    (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp, AsyncScatterWork::getInputTensors: newLikeFlat(inputs[0])),
    and drops it at once. Counted for every scatter, 0 bytes on the ranks that receive; `staged`: the allocation
    ids of those of some bytes."""

    def __init__(self, scratch: Any) -> None:
        super().__init__()
        self.scratch = scratch
        self.staged: list[int] = []

    def record(self, func: Any, args: tuple, kwargs: dict | None) -> tuple[str, int] | None:  # noqa: D102
        if func.namespace == "c10d" and func._opname == "scatter_":
            # (output_tensors, input_tensors: [scatter list] on the root, [] elsewhere, group, root, ...)
            lists = args[1] if len(args) > 1 else []
            nbytes = len(lists[0]) * _local_bytes(lists[0][0]) if lists and lists[0] else 0
            aids = self.scratch(nbytes)
            self.staged += aids if nbytes else []
        return super().record(func, args, kwargs)

"""Probing a kernel: one op run for real on zeros of a traced op's shapes to size the scratch it holds inside
itself; what decides a probe's result, its inputs, its size limit and the trace's cache of results."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from advisor.estimate.trace import Tracker

# A real probe of one op allocates its inputs, outputs and scratch; past this many input bytes
# the op is left unsized (its scratch then counts as nothing, as on other targets).
PROBE_INPUT_LIMIT = 1 << 30


def probe_key(func: Any, args: tuple, kwargs: dict | None = None,
              entries: Callable[[Any], int] | None = None) -> str:
    """What decides a probed op's workspace or scratch: the op, its tensors' shapes, strides and dtypes
    (a layout changes which kernel runs, and whether it copies an input first), its scalars; a sparse
    COO tensor's entries (`entries(t)`, else its own count) and whether they are coalesced."""
    import torch
    from torch.utils._pytree import tree_map

    def describe(a: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        if a.layout == torch.sparse_coo:
            return (tuple(a.shape), "coo", entries(a) if entries else a._nnz(), a.is_coalesced(), a.dtype)
        return (tuple(a.shape), a.stride(), a.dtype)

    return repr([func, *tree_map(describe, list(args)), *sorted(tree_map(describe, kwargs or {}).items())])


def real_like(args: Any, device: str = "cpu", entries: Callable[[Any], int] | None = None) -> Any:
    """Real zeros on `device` for each fake tensor in `args` (nested lists and dicts too), same shape,
    strides and dtype (a layout such as channels_last changes which kernel runs); a sparse COO one,
    `_real_sparse` of its entries (`entries(t)`, else its own count)."""
    import torch
    from torch.utils._pytree import tree_map

    def real(a: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        if a.layout == torch.sparse_coo:
            return _real_sparse(a, entries(a) if entries else a._nnz(), device)
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=device).zero_()

    return tree_map(real, args)


def _real_sparse(a: Any, entries: int, device: str = "cpu") -> Any:
    """A real sparse COO tensor of `a`'s shape, dtype and coalesced flag, holding `entries` zero entries
    (at most one per cell) spread evenly over its sparse dimensions in order: a kernel sizes its buffers
    by the count and the shape, which a graph's real edges share."""
    import torch

    sizes = tuple(a.shape[:a.sparse_dim()])
    cells = math.prod(sizes)
    n = min(entries, cells)
    flat = torch.arange(n, dtype=torch.int64, device=device) * (cells // max(n, 1))
    indices = torch.stack(torch.unravel_index(flat, sizes)) if sizes else flat.new_zeros((0, n))
    values = torch.zeros((n, *a.shape[a.sparse_dim():]), dtype=a.dtype, device=device)
    return torch.sparse_coo_tensor(indices, values, a.shape, is_coalesced=a.is_coalesced(), check_invariants=False)


def affordable(args: Any, nbytes: Callable[[Any], int] | None = None) -> bool:
    """Whether a probe's inputs (`nbytes(t)` each, else the tensor's own) stay within PROBE_INPUT_LIMIT."""
    import torch
    from torch.utils._pytree import tree_flatten

    size = nbytes or (lambda a: a.nbytes)
    return sum(size(a) for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)) <= PROBE_INPUT_LIMIT


def probed_blocks(tracker: Tracker, func: Any, args: tuple, kwargs: dict, blocks: Callable[[], tuple[int, ...]],
                  count: int = 1, counted_in: set[str] | None = None) -> tuple[int, ...]:
    """The scratch of one op shape, `count` blocks measured by `blocks()` the first time it is seen (cached in
    `tracker.probed` by `probe_key`); 0 bytes each where its inputs are past PROBE_INPUT_LIMIT. `counted_in`:
    the tracker's set of probes of one kind (copies, reductions, products) that the key joins."""
    if not affordable((args, kwargs), tracker.bytes_of):
        return (0,) * count
    key = probe_key(func, args, kwargs, tracker.entries_of)
    if counted_in is not None:
        counted_in.add(key)
    if key not in tracker.probed:
        tracker.probed[key] = tuple(blocks())
    return tracker.probed[key]


@functools.lru_cache(maxsize=1)
def stride_ops() -> tuple[frozenset, frozenset]:
    """(ops that take any strides or are the copy themselves, matrix products that take either unit stride)."""
    import torch

    aten = torch.ops.aten
    copies = frozenset({aten._to_copy.default, aten.copy_.default, aten.clone.default})
    products = frozenset({aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.addbmm})
    return copies, products


def may_copy_strided(tracker: Tracker, func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the op's kernel may copy a strided input to a contiguous buffer inside itself (ATen's
    `.contiguous()` and `expect_contiguous()`, e.g. softmax's backward on the transposed gradient of an attention
    product): an allocation no dispatch shows, which only a real run on the same strides measures. Candidates: an
    op that is not a view, not pointwise (TensorIterator walks any strides), not seeded (a probe would draw from
    the RNG), with a non-contiguous tensor input of any size; a matrix product only where such an input has no
    unit stride in its last two dimensions (BLAS takes either). No size threshold: one that grows with the batch
    would fall between the batch model's two traces, which then make different allocations (batchmodel.py)."""
    import torch
    from torch.utils._pytree import tree_flatten

    skip = (torch.Tag.pointwise, torch.Tag.nondeterministic_seeded, torch.Tag.inplace_view)
    if func.namespace != "aten" or func.is_view or any(tag in func.tags for tag in skip):
        return False
    copies, products = stride_ops()
    if func in copies:
        return False
    tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
    if any(a.layout != torch.strided for a in tensors):  # a sparse op: probed as one (scratch_cpu.is_sparse_op)
        return False
    strided = [a for a in tensors if not a.is_contiguous()]
    if func.overloadpacket in products:
        strided = [a for a in strided if 1 not in a.stride()[-2:]]
    return bool(strided)

"""What CPU kernels hold beyond their outputs, which fake ops leave out: oneDNN's RNN workspace and the scratch of
convolutions, 16-bit matrix products, reductions, strided copies and sparse ops, each sized by a probe."""

from __future__ import annotations

import contextlib
import functools
import os
from typing import TYPE_CHECKING, Any

from advisor.estimate import scratch_cuda
from advisor.estimate.cuda_reduce import is_reduction
from advisor.estimate.kernel_probe import affordable, probe_key, probed_blocks, real_like, stride_ops

if TYPE_CHECKING:
    from advisor.estimate.trace import Tracker

# A 16-bit dtype's matrix products are probed where one of this CPU's holds scratch of at least this share of its
# output beside it (`products_holding_scratch`): a buffer that grows with the output, as AMX's float32 one does
PRODUCT_SCRATCH_SHARE = 0.5


@functools.lru_cache(maxsize=1)
def _rnn_layer() -> Any:
    import torch

    return torch.ops.aten.mkldnn_rnn_layer.default


def is_rnn_layer(tracker: Tracker, func: Any, args: tuple, kwargs: dict) -> bool:
    return func is _rnn_layer()


def rnn_workspace(tracker: Tracker, func: Any, args: tuple, kwargs: dict, out: tuple) -> tuple:
    """oneDNN's RNN keeps a workspace from forward to backward whose size its kernel decides (by CPU, shape and
    dtype), and writes only part of it (a third in fp32 training, at every batch size). On fake tensors with this
    CPU the target, the op reports none: it is run once on real zeros of the same shapes (one layer's input,
    weights and output: small next to the model) and the fake trace gets a workspace of the real size. Either way
    the bytes the kernel left unwritten are recorded (`resident_bytes`): they never join the resident set. On a
    CUDA target sized here, cuDNN's reserve space instead (`scratch_cuda.rnn_layer_reserve`)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    from advisor.procmem import resident_bytes

    workspace = out[3]
    if not isinstance(workspace, FakeTensor):  # real tensors: the real kernel allocated the real workspace
        written = resident_bytes(workspace.data_ptr(), workspace.nbytes)
        tracker.track(workspace, untouched=workspace.nbytes - (workspace.nbytes if written is None else written))
        return out
    untouched = 0
    if tracker.cpu_workspaces and affordable(args):
        key = probe_key(torch.ops.aten.mkldnn_rnn_layer.default, args)
        if key not in tracker.workspace_bytes:
            _probe_rnn_workspace(tracker, key, args)
        n = tracker.workspace_bytes[key]
        if n != workspace.nbytes:
            workspace = torch.empty(n, dtype=torch.uint8, device=workspace.device)
            out = (*out[:3], workspace)
        untouched = tracker.workspace_untouched[key]
    elif tracker.cuda_workspaces:
        return scratch_cuda.rnn_layer_reserve(tracker, args, out)
    # recorded first whether sized or not, so two traces' allocations come in the same order (batchmodel.py)
    tracker.track(workspace, untouched=untouched)
    return out


def _probe_rnn_workspace(tracker: Tracker, key: str, args: tuple) -> None:
    """Run mkldnn_rnn_layer on real zeros of `args`' shapes; record its workspace's bytes and those it never
    writes under `key` (0 where this CPU has no kernel for it)."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from advisor.procmem import resident_bytes

    # not under no_grad: the kernel keeps a workspace only when gradients are on (inputs need none)
    with unset_fake_temporarily():
        try:
            found = torch.ops.aten.mkldnn_rnn_layer.default(*real_like(args))[3]
        except Exception:  # noqa: BLE001 - no kernel for this here (bf16 LSTM without AVX512-BF16): none to size
            found = None
        n = int(found.nbytes) if found is not None else 0
        written = resident_bytes(found.data_ptr(), n) if found is not None else None
        tracker.workspace_bytes[key] = n
        tracker.workspace_untouched[key] = n - (n if written is None else written)
        del found


@functools.lru_cache(maxsize=1)
def _onednn_scratch_ops() -> frozenset:
    """CPU kernels that allocate scratch inside themselves through torch's allocator (oneDNN's)."""
    import torch

    aten = torch.ops.aten
    return frozenset({aten.mkldnn_rnn_layer_backward.default, aten.convolution.default,
                      aten.convolution_backward.default})


def is_onednn_scratch_op(tracker: Tracker, func: Any, args: tuple, kwargs: dict) -> bool:
    return func in _onednn_scratch_ops()


def is_half_product(tracker: Tracker, func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the op is a matrix product of 16-bit floats (bf16, fp16: autocast's linear layers and attention) of
    a dtype whose products hold a buffer beside their output on this CPU (`tracker.scratch_products`). oneDNN's
    matmul on a CPU with AMX holds a float32 buffer of the output's size or more beside it (bf16 (32, 10) x
    (10, 8192), a linear layer's input gradient: 1058432 bytes beside the 512 KiB output; fp16 (512, 768) x
    (768, 768): 2.9 MB beside 768 KiB); float32 products hold none. Not affine in the batch (largest.py)."""
    import torch

    products = stride_ops()[1]
    return (func.overloadpacket in products and isinstance(args[0], torch.Tensor)
            and args[0].dtype in tracker.scratch_products)


def scratch_products() -> frozenset:
    """The 16-bit dtypes whose matrix products are probed on this CPU (`products_holding_scratch` at
    PRODUCT_SCRATCH_SHARE)."""
    return products_holding_scratch(PRODUCT_SCRATCH_SHARE)


# The products that decide whether a 16-bit dtype's products are probed, (m, k, n): a skinny one (a linear layer's
# input gradient) and a square one. Kernels pick their blocking by shape: an AMX CPU's fp16 product holds 6% of its
# output beside the skinny one and 3.7 times it beside the square one; both outputs are large enough (512 and 768
# KiB) that a fixed buffer of ~258 KiB (a Zen 4's bf16 products) stays under half of them.
CANARY_PRODUCTS = ((32, 10, 8192), (512, 768, 768))


@functools.cache
def products_holding_scratch(share: float) -> frozenset:
    """The 16-bit dtypes whose matrix products hold scratch of at least `share` of their output beside it on this
    CPU, in any of CANARY_PRODUCTS run once under the profiler (milliseconds each where the dtype has fast kernels).
    Only theirs are probed: the probes cost a real run of every product shape and, where they find scratch, the
    largest batch is searched again on exact traces (largest.py). An AMX CPU holds buffers that grow with the
    product; a CPU with avx512_bf16 and no AMX (a Zen 4) holds a buffer of about 258 KiB whatever the product's
    size beside its bf16 products and nothing beside its fp16 ones, which it runs slowly ((2048, 768) x
    (768, 3072) in 10.4 s against bf16's 0.03 s): probing them would cost minutes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from advisor.measure import memory_events

    holding = set()
    for dtype in (torch.bfloat16, torch.float16):
        for m, k, n in CANARY_PRODUCTS:
            a, b = torch.zeros(m, k, dtype=dtype), torch.zeros(k, n, dtype=dtype)
            with _stderr_to_devnull(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                out = torch.mm(a, b)
                del out
            output = m * n * dtype.itemsize
            scratch = sum(x for x in memory_events(prof) if x > 0) - output
            if scratch > 0 and scratch >= share * output:
                holding.add(dtype)
                break
    return frozenset(holding)


def is_cpu_reduction(tracker: Tracker, func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the op is a reduction, whose CPU kernel may allocate inside itself through torch's allocator: a
    mean over a 16-bit float input sums a float32 copy of it, twice the input's bytes (bf16 and fp16 alike, over
    all dimensions or some; a sum does not copy), and logsumexp holds a buffer of its input's size in any dtype."""
    import torch

    return is_reduction(func) or func is torch.ops.aten.logsumexp.default


def is_sparse_op(tracker: Tracker, func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the op takes a sparse COO tensor (and no other non-strided one): its CPU kernel may hold buffers
    inside itself that no dispatch shows, fake or real, which a real run on an input of as many entries measures.
    torch.sparse.mm's (`_sparse_addmm`) holds a buffer of its output's size beside the output."""
    import torch
    from torch.utils._pytree import tree_flatten

    if func.namespace != "aten" or func.is_view or torch.Tag.nondeterministic_seeded in func.tags:
        return False
    layouts = {a.layout for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
    return torch.sparse_coo in layouts and layouts <= {torch.sparse_coo, torch.strided}


@contextlib.contextmanager
def _stderr_to_devnull():
    """The profiler's C++ side writes a line to fd 2 as it starts and stops; keep it off the user's screen."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def real_scratch(tracker: Tracker, func: Any, args: tuple, kwargs: dict, out: Any, kind: str | None = None) -> Any:
    """Record the scratch a CPU kernel allocates inside itself; returns `out`. The op runs once on real zeros of
    the same strides (a sparse input with as many entries as the trace holds) under the profiler, and the trace
    records two fake allocations that die at once (`scratch_blocks`), so its peak sees them beside the outputs.
    The scratch is the probe's peak over what it held before (its outputs counted in it); for a reduction, over
    the outputs it leaves, as the trace holds its output already. `kind` ("copy", "reduction", "product" or
    None) counts the probe apart (Trace.probed_copies, probed_reductions, probed_products)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_flatten

    if not any(isinstance(a, FakeTensor) for a in tree_flatten((args, kwargs))[0]):
        return out
    counted_in = {"copy": tracker.copy_probes, "reduction": tracker.reduction_probes,
                  "product": tracker.product_probes}.get(kind)
    measure = functools.partial(_profiled_blocks, tracker, func, args, kwargs, kind == "reduction")
    tracker.scratch(*probed_blocks(tracker, func, args, kwargs, measure, count=2, counted_in=counted_in))
    return out


def _profiled_blocks(tracker: Tracker, func: Any, args: tuple, kwargs: dict, reduction: bool) -> tuple[int, int]:
    """`scratch_blocks` of one real run of the op under the profiler; (0, 0) where it has no kernel here."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.profiler import ProfilerActivity, profile

    from advisor.measure import memory_events

    with unset_fake_temporarily():
        try:
            real, real_kwargs = real_like((args, kwargs), entries=tracker.entries_of)
            with _stderr_to_devnull(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                outputs = func(*real, **real_kwargs)
                if not reduction:
                    del outputs
            return scratch_blocks(memory_events(prof))
        except Exception:  # noqa: BLE001 - no kernel for this here: nothing to size, and a probe never fails the trace
            return 0, 0


def scratch_blocks(events: list[int]) -> tuple[int, int]:
    """A probe's scratch from its allocator's events in order (bytes allocated +, freed -): the peak of their
    running sum over where it ends, as (the largest block live at the peak that is freed by the end, the rest).
    In the kernel's own sizes, so that a calibration run's heap log, which requests them, is resized with the
    trace (heaplog.rescaled): one block of their sum would be a size the log never requests. Frees are paired
    with the last live allocation of their size (the events carry no addresses)."""
    live: list[tuple[int, int]] = []  # (event index, bytes) allocated and not yet freed
    total = peak = 0
    at_peak: list[tuple[int, int]] = []
    for i, n in enumerate(events):
        total += n
        if n > 0:
            live.append((i, n))
        elif n < 0:
            j = next((k for k in range(len(live) - 1, -1, -1) if live[k][1] == -n), None)
            if j is not None:
                del live[j]
        if total > peak:
            peak, at_peak = total, list(live)
    scratch = max(0, peak - total)
    kept = {i for i, _ in live}
    largest = min(scratch, max((n for i, n in at_peak if i not in kept), default=0))
    return largest, scratch - largest

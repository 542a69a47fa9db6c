"""Trace two real training steps on fake tensors and record every storage allocation and free.

Nothing is allocated: the model is built and stepped under FakeTensorMode, so any nn.Module is
covered, whatever its size. A TorchDispatchMode above the fake mode sees each aten op's outputs;
a weakref finalizer on each new storage tells when it dies. Replaying the log gives the live
bytes after every event, split by what each allocation is for (the categories below).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from advisor.config import OptimizerKind, Precision
from advisor.errors import EstimateError
from advisor.estimate.autocast_cuda import cuda_policy
from advisor.estimate.cuda_reduce import ReduceGpu, ReduceSpec, is_reduction, reduction_spec, scratch_slots
from advisor.workload import Workload

# Category indices of the live-bytes curve.
# PARAM_COPIES: low-precision copies of parameters made in forward (autocast's weight cache);
# under ZeRO-3 they exist only for the gathered units, so they scale with the parameters.
PARAMS, GRADS, OPT_STATE, ACTIVATIONS, TEMPORARIES, STEP_TEMPS, INPUTS, PARAM_COPIES = range(8)
CATEGORY_NAMES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "step_temporaries", "inputs",
                  "param_copies")
_PHASE_LABEL = {"build": PARAMS, "batch": INPUTS, "forward": ACTIVATIONS, "backward": TEMPORARIES,
                "step": STEP_TEMPS, "done": TEMPORARIES}


# A trace is the build (phase 0) and TRACED_STEPS training steps, each in these phases in turn (Trace.phases);
# a logged run marks the same ones (heaplog.phase_marks).
TRACED_STEPS = 2
STEP_PHASES = ("batch", "forward", "backward", "step", "done")


@dataclass
class Trace:
    """What one traced run (build + 2 steps) allocated, as a curve of live bytes by category."""

    curve: np.ndarray  # (events, 8) int64: live bytes per category after each event
    sizes: np.ndarray  # (events,) int64: +bytes for an allocation, -bytes for a free, in order
    ids: np.ndarray  # (events,) int64: which allocation each event is about
    param_bytes: int  # parameters and buffers (bytes)
    grad_bytes: int  # gradients alive at once at the optimizer step (bytes); fused step: largest one
    opt_state_bytes: int  # optimizer state after the second step (bytes)
    largest_block_bytes: int  # parameters of the largest repeated block (bytes): FSDP's unit
    flops_per_step: int  # forward + backward FLOPs of one step (torch.utils.flop_counter)
    num_params: int
    seconds: float
    synthetic: bool = False  # built from formulas: sizes are moments, not an allocation sequence
    sized_kernels: int = 0  # kernel workspaces/scratch sized by running the op for real on this machine
    sized_on: str = "cpu"  # where they were sized: "cpu" (oneDNN) or "cuda" (cuDNN, on this machine's GPU)
    probed_copies: int = 0  # op shapes with a strided input run for real, for a contiguous copy inside their kernel
    probed_reductions: int = 0  # reduction op shapes run for real whose kernels hold scratch (`_cpu_reduction`)
    probed_products: int = 0  # 16-bit matrix product shapes run for real whose kernels hold scratch (`_half_product`)
    # threads whose ops call cuBLAS (`_cublas_ops`): the step's own (forward, optimizer) and autograd's backward,
    # which on CUDA runs on a device thread of its own; each gets a cuBLAS handle with a workspace (cuda_alloc)
    cublas_threads: int = 2
    # where each thread first runs a cuBLAS op, and a cuBLASLt one: ((event index, "cublas" or "cublaslt"), ...);
    # its workspace is taken from the caching allocator right after that op's outputs (cuda_alloc.library_workspaces)
    cublas_at: tuple[tuple[int, str], ...] = ()
    # reduction op shapes whose cross-block scratch was worked out for a GPU not at hand (cuda_reduce.py)
    reduce_scratch: int = 0
    # that GPU, and each such scratch allocation: (allocation id, slot of cuda_reduce.scratch_slots, the
    # reduction), so that the batch model works it out again at another batch (it is not affine in the batch)
    reduce_gpu: ReduceGpu | None = None
    reduce_specs: tuple[tuple[int, int, ReduceSpec], ...] = ()
    # cuDNN op shapes (convolutions, LSTM layers) whose workspaces a GPU not at hand leaves unsized
    unsized_cudnn: int = 0
    # the model was built with torch.nn.init's initializers as no-ops: its build read a fake tensor's value
    init_skipped: bool = False
    # ctc_loss calls whose target lengths were tensors (no values when fake): sized at the longest allowed
    ctc_bounded: int = 0
    # (events,) int64, signed as `sizes`: the bytes of each allocation its kernel never writes (pages
    # that stay out of the resident set, e.g. the unused part of oneDNN's RNN workspace); None: all
    untouched: np.ndarray | None = None
    # (events,) int64: the phase each event falls in, counted from 0 (the build), then each step's batch, forward,
    # backward, step and done in turn: the same sequence at any batch, so traces whose allocations differ are
    # still matched moment by moment (batchmodel.BatchModel._peaks_at); None: not recorded
    phases: np.ndarray | None = None

    @property
    def peak_bytes(self) -> int:
        return int(self.curve.sum(axis=1).max()) if len(self.curve) else 0


class _Tracker:
    """Records storage allocations/frees seen through dispatch; labels them by phase."""

    def __init__(self) -> None:
        from torch.utils.weak import WeakIdKeyDictionary

        self.phase = "build"
        self.phase_marks: list[int] = []  # the event index where each phase after the build begins
        self.live_ids: dict[int, int] = {}  # storage pointer -> allocation id
        self.labels: list[int] = []  # allocation id -> category
        self.nbytes: list[int] = []  # allocation id -> bytes
        self.events: list[int] = []  # +(id+1) alloc, -(id+1) free
        self.flops = 0
        self.count_flops = False
        self.param_keys: set[int] = set()  # storages of the model's parameters
        self.cpu_workspaces = False  # size oneDNN's workspaces and scratch by running those ops for real
        self.cuda_workspaces = False  # size CUDA kernels' scratch (`_cuda_scratch_ops`, LSTMs) by running them on the GPU
        self.cudnn_tf32 = False  # whether the run lets cuDNN use TF32 (precision tf32): it picks other algorithms
        self.reduce_gpu: ReduceGpu | None = None  # a CUDA target not at hand: reductions' scratch from torch's rules
        self.reduce_scratch: set[ReduceSpec] = set()  # reductions that took some (`_reduction_scratch`)
        self.reduce_specs: list[tuple[int, int, ReduceSpec]] = []  # see Trace.reduce_specs
        self.ctc_bounded = 0  # ctc_loss calls whose target lengths were tensors: sized at their bound (_ctc_fake)
        self.unsized_cudnn: set[str] = set()  # with reduce_gpu: cuDNN op shapes whose workspace nothing sizes
        self.workspace_bytes: dict[str, int] = {}  # an LSTM layer's shapes, dtypes and scalars -> its workspace's bytes
        self.probed: dict[str, tuple[int, ...]] = {}  # a probed op's shapes, ... -> its scratch's blocks (`_probed_blocks`)
        self.copy_probes: set[str] = set()  # keys of `probed` probed for a contiguous copy of a strided input
        self.reduction_probes: set[str] = set()  # keys of `probed` probed for a reduction's scratch
        self.product_probes: set[str] = set()  # keys of `probed` probed for a 16-bit matrix product's scratch
        self.scratch_products: frozenset = frozenset()  # 16-bit dtypes whose products hold scratch here (probed)
        self.workspace_untouched: dict[str, int] = {}  # ... -> bytes of the workspace its kernel never writes
        self.rnn_sizes: dict[str, tuple[int, int, int]] = {}  # ... -> cuDNN's LSTM (see `_cudnn_rnn_sizes`)
        self.untouched: dict[int, int] = {}  # allocation id -> bytes never written (see Trace.untouched)
        # (thread: "main" or "backward", "cublas"/"cublaslt") -> event index of that thread's first such op
        self.cublas_at: dict[tuple[str, str], int] = {}
        self.finalizers: dict[int, weakref.finalize] = {}  # storage pointer -> its death notice
        self.sparse_entries: dict[Any, int] = WeakIdKeyDictionary()  # see `track_sparse`
        # True between an autograd node's apply and the next node's: the engine is adding the node's
        # outputs into the input buffers of the nodes they feed (see `accumulates_in_place`)
        self.accumulating = False
        self.paused = False  # `off_device`

    @contextlib.contextmanager
    def off_device(self, on: bool):
        """While `on`, record nothing: a CUDA target's build and batches are made on the CPU and only what is
        moved reaches the device (`_moved_to_device`)."""
        self.paused = on
        try:
            yield
        finally:
            self.paused = False

    def set_phase(self, name: str) -> None:
        self.phase = name
        self.phase_marks.append(len(self.events))
        self.accumulating = False  # every phase change falls outside backward's node sequence

    def track(self, t: Any, category: int | None = None, untouched: int = 0, nbytes: int | None = None) -> None:
        """Record `t`'s storage as a new allocation, unless it is already live; `untouched`: bytes of
        it that its kernel never writes; `nbytes`: its size where the storage's is not it (`track_sparse`).
        A sparse tensor's allocations are its index and value tensors' (`_sparse_parts`)."""
        import torch

        if not isinstance(t, torch.Tensor) or self.paused:
            return
        if t.layout != torch.strided:
            for part in _sparse_parts(t):
                self.track(part, category)
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live_ids:
            return
        aid = len(self.nbytes)
        if untouched:
            self.untouched[aid] = untouched
        self.live_ids[key] = aid
        self.nbytes.append(int(st.nbytes()) if nbytes is None else nbytes)
        self.labels.append(_PHASE_LABEL[self.phase] if category is None else category)
        self.events.append(aid + 1)
        self.finalizers[key] = weakref.finalize(st, self._free, key, aid)

    def track_sparse(self, out: Any, inputs: list[Any], category: int | None = None) -> None:
        """A sparse COO output of a fake op, which stores no entries (fake kernels cannot know how many a
        transpose or coalesce keeps: torch.sparse.mm's backward transposes the adjacency), sized as holding
        as many as its largest sparse input: exact for a transpose, a bound for a coalesce. A small GCN's fake
        trace came out 7% under its real trace without it, and equal with it (session 51). What a sparse op's
        CPU kernel holds inside itself, neither trace sees: a probe measures it (`_sparse_op`)."""
        import torch

        entries = max((self.entries_of(a) for a in inputs if a.layout == torch.sparse_coo), default=0)
        if out.layout != torch.sparse_coo or out._nnz() or not entries:
            self.track(out, category)
            return
        self.sparse_entries[out] = entries  # for the ops that take it in turn
        index_bytes, value_bytes = _coo_bytes(out, entries)
        self.track(out._indices(), category, nbytes=index_bytes)
        self.track(out._values(), category, nbytes=value_bytes)

    def entries_of(self, t: Any) -> int:
        """A sparse COO tensor's entries as the trace holds them (`track_sparse`)."""
        return self.sparse_entries.get(t, t._nnz())

    def bytes_of(self, t: Any) -> int:
        """A tensor's bytes; a sparse one's, its index and value tensors' (a sparse gradient's, from
        nn.Embedding(sparse=True), and SGD's momentum buffer of it), as many entries as `track_sparse` sized."""
        import torch

        if t.layout == torch.strided:
            return int(t.nbytes)
        entries = self.sparse_entries.get(t)
        if entries is None or t.layout != torch.sparse_coo:
            return sum(int(p.nbytes) for p in _sparse_parts(t))
        return sum(_coo_bytes(t, entries))

    def scratch(self, *nbytes: int) -> list[int]:
        """Blocks an op holds only while it runs (a probed op's scratch, a reduction's): allocated in order,
        then freed, the last first; their allocation ids, none while paused. Recorded as events without making
        tensors (a fake allocation costs a dispatch through FakeTensorMode), and for every candidate op even
        where 0 bytes (the probe found none, or its inputs were past PROBE_INPUT_LIMIT): the batch model
        matches two traces' allocations by their order (batchmodel.py), and a probe that measures scratch at
        one batch size and none at the other (a limit crossed between them, a kernel that copies only past
        some size) must not shift that order."""
        if self.paused:
            return []
        aids = list(range(len(self.nbytes), len(self.nbytes) + len(nbytes)))
        self.nbytes.extend(int(n) for n in nbytes)
        self.labels.extend([_PHASE_LABEL[self.phase]] * len(nbytes))
        self.events.extend(aid + 1 for aid in aids)
        self.events.extend(-(aid + 1) for aid in reversed(aids))
        return aids

    def _free(self, key: int, aid: int) -> None:
        if self.live_ids.get(key) == aid:
            del self.live_ids[key]
            del self.finalizers[key]
        self.events.append(-(aid + 1))

    def reuse(self, t: Any, donor: Any) -> None:
        """`t` took over `donor`'s memory (an accumulation the real engine does in place): no new
        allocation; the donor's allocation lives on until `t`'s storage dies."""
        old = donor.untyped_storage()._cdata
        aid = self.live_ids.pop(old, None)
        if aid is None:
            self.track(t)
            return
        self.finalizers.pop(old).detach()
        st = t.untyped_storage()
        self.live_ids[st._cdata] = aid
        self.finalizers[st._cdata] = weakref.finalize(st, self._free, st._cdata, aid)

    def watch_backward(self, root: Any) -> None:
        """Mark, on every autograd node of `root`'s graph, when its apply ends (post-hook) and the
        next one begins (pre-hook). The hooks hold no node: a node held by its own hook would keep
        its graph, and every tensor saved in it, alive."""
        def ended(_grad_inputs, _grad_outputs) -> None:
            self.accumulating = True

        def begins(_grad_outputs) -> None:
            self.accumulating = False

        seen: set[Any] = set()
        todo = [root.grad_fn] if root.grad_fn is not None else []
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            node.register_prehook(begins)
            if node.next_functions:  # AccumulateGrad's post-hooks would change whether it steals the grad
                node.register_hook(ended)
            todo.extend(n for n, _ in node.next_functions if n is not None)

    def relabel(self, t: Any, category: int) -> None:
        import torch

        if t.layout != torch.strided:  # a sparse gradient (nn.Embedding(sparse=True))
            for part in _sparse_parts(t):
                self.relabel(part, category)
            return
        aid = self.live_ids.get(t.untyped_storage()._cdata)
        if aid is not None:
            self.labels[aid] = category


def _dispatch_mode(tracker: _Tracker):
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.flop_counter import flop_registry

    cublas_ops = _cublas_ops()
    # what allocates nothing and is most of a trace's calls: a fake tensor's device is answered in Python,
    # and the autograd engine asks it of every gradient; .item() on the optimizer's step counters
    queries = {torch.ops.prim.device.default, torch.ops.aten.size.default, torch.ops.aten.stride.default,
               torch.ops.aten.storage_offset.default, torch.ops.aten._local_scalar_dense.default}

    ctc_ops = {torch.ops.aten._ctc_loss.default, torch.ops.aten._ctc_loss.Tensor,
               torch.ops.aten._ctc_loss_backward.default, torch.ops.aten._ctc_loss_backward.Tensor}

    class TrackingMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in queries:
                return func(*args, **(kwargs or {}))
            kwargs = kwargs or {}
            ctc = func in ctc_ops and isinstance(args[0], FakeTensor)  # fake ops refuse it: its shape needs values
            out = _ctc_fake(tracker, func, args) if ctc else func(*args, **kwargs)
            if type(out) is tuple:
                out = _aliased_as_the_kernel(func, out)
            if ctc:  # its scratch is _ctc_fake's: no probe on zeros (whose lengths would size none)
                pass
            elif func is torch.ops.aten.mkldnn_rnn_layer.default:
                out = _rnn_workspace(tracker, args, out)
            elif tracker.cuda_workspaces and func is torch.ops.aten.mkldnn_rnn_layer_backward.default:
                out = _cudnn_rnn_backward_scratch(tracker, args, out)
            elif tracker.cpu_workspaces and func in _scratch_ops():
                _real_scratch(tracker, func, args, kwargs)
            elif tracker.cpu_workspaces and _half_product(func, args, tracker.scratch_products):
                _real_scratch(tracker, func, args, kwargs, product=True)
            elif tracker.cpu_workspaces and _cpu_reduction(func):
                _real_scratch(tracker, func, args, kwargs, reduction=True)
            elif tracker.cpu_workspaces and _may_copy_strided(func, args, kwargs):
                _real_scratch(tracker, func, args, kwargs, copy=True)
            elif tracker.cpu_workspaces and _sparse_op(func, args, kwargs):
                _real_scratch(tracker, func, args, kwargs)
            elif tracker.cuda_workspaces and func in _cuda_scratch_ops():
                out = _cuda_scratch(tracker, func, args, kwargs, out)
            elif tracker.cuda_workspaces and _may_copy_strided(func, args, kwargs):
                out = _cuda_scratch(tracker, func, args, kwargs, out, copy=True)
            elif tracker.reduce_gpu is not None and is_reduction(func):
                out = _reduction_scratch(tracker, func, args, kwargs, out)
            elif tracker.reduce_gpu is not None and func in _cudnn_ops():
                tracker.unsized_cudnn.add(_probe_key(func, args, kwargs))
            if func is torch.ops.aten.add.Tensor and tracker.accumulating and accumulates_in_place(args):
                tracker.reuse(out, args[0])
                return out
            category = None
            if (func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor)
                    and args[0].layout == torch.strided and args[0].untyped_storage()._cdata in tracker.param_keys):
                category = PARAM_COPIES
            if isinstance(out, FakeTensor) and out.layout == torch.sparse_coo:
                tracker.track_sparse(out, [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)],
                                     category)
            elif isinstance(out, torch.Tensor):  # the common case, without pytree's cost
                tracker.track(out, category)
            else:
                for t in tree_flatten(out)[0]:
                    tracker.track(t, category)
            if func.overloadpacket in cublas_ops:
                thread = "backward" if tracker.phase == "backward" else "main"
                for kind in ("cublas", "cublaslt") if _runs_on_cublaslt(func, args, kwargs) else ("cublas",):
                    tracker.cublas_at.setdefault((thread, kind), len(tracker.events))
            if tracker.count_flops and func.overloadpacket in flop_registry:
                tracker.flops += int(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))
            return out

    return TrackingMode()


def _ctc_fake(tracker: _Tracker, func: Any, args: tuple) -> Any:
    """CTC loss on fake tensors, which refuse it: its alpha table (and backward's beta) holds 2 x the longest
    target + 1 entries per frame, and target lengths given as a tensor have no values here. Its kernels'
    allocations (ATen's LossCTC.cpp and .cu): forward, log_alpha (N, T, 2 x S + 1) and the per-sample loss;
    backward, the gradient like log_probs, then log_beta like log_alpha while it runs. S is the longest
    target the lengths allow: their largest where given as ints, else the padded targets' width (N, S), or
    for concatenated 1-D targets their count capped at T (a longer target has no alignment). An
    overestimate where every target is shorter: by (S - longest) x 2 x N x T elements, on top of log_probs'
    own N x T x classes."""
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

    Two gradients for one input of a node (a tensor used twice: tied embeddings, a residual
    fork) are summed in that node's input buffer. With no grad mode and the buffered gradient
    `args[0]` a plain dense tensor whose memory nothing else holds, the engine adds in place
    (torch/csrc/autograd/input_buffer.cpp, `can_accumulate_inplace`); under any Python dispatch
    mode, such as the tracer's and FakeTensorMode, it counts every tensor as a subclass and adds
    out of place, allocating a third gradient the real step never has. Not seen here: a second
    reference to the same tensor (one gradient sent to two places, both still waiting), which
    the engine also refuses; the buffered gradient is taken as its only holder.
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


def _coo_bytes(t: Any, entries: int) -> tuple[int, int]:
    """The bytes of sparse COO `t`'s index and value tensors were they to hold `entries` entries."""
    values = t._values()
    return (t.sparse_dim() * entries * t._indices().element_size(),
            entries * math.prod(values.shape[1:]) * values.element_size())


def _sparse_parts(t: Any) -> list[Any]:
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


def _rnn_workspace(tracker: _Tracker, args: tuple, out: tuple) -> tuple:
    """oneDNN's RNN keeps a workspace from forward to backward whose size its kernel decides (by
    CPU, shape and dtype), and writes only part of it (measured here: a third in fp32 training,
    at every batch size). On fake tensors (where the target is this CPU) the op reports none: run
    it once on real zeros of the same shapes (one layer's input, weights and output: small next
    to the model) and give the fake trace a workspace of the real size. Either way, record the
    bytes the kernel left unwritten (`resident_bytes`): they never join the resident set."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    from advisor.procmem import resident_bytes

    workspace = out[3]
    if not isinstance(workspace, FakeTensor):  # real tensors: the real kernel allocated the real workspace
        written = resident_bytes(workspace.data_ptr(), workspace.nbytes)
        tracker.track(workspace, untouched=workspace.nbytes - (workspace.nbytes if written is None else written))
        return out
    untouched = 0
    if tracker.cpu_workspaces and _affordable(args):
        key = _probe_key(torch.ops.aten.mkldnn_rnn_layer.default, args)
        if key not in tracker.workspace_bytes:
            # not under no_grad: the kernel keeps a workspace only when gradients are on (inputs need none)
            with unset_fake_temporarily():
                try:
                    found = torch.ops.aten.mkldnn_rnn_layer.default(*_real_like(args))[3]
                except Exception:  # noqa: BLE001 - no kernel for this here (bf16 LSTM without AVX512-BF16): none to size
                    found = None
                n = int(found.nbytes) if found is not None else 0
                written = resident_bytes(found.data_ptr(), n) if found is not None else None
                tracker.workspace_bytes[key] = n
                tracker.workspace_untouched[key] = n - (n if written is None else written)
                del found
        n = tracker.workspace_bytes[key]
        if n != workspace.nbytes:
            workspace = torch.empty(n, dtype=torch.uint8, device=workspace.device)
            out = (*out[:3], workspace)
        untouched = tracker.workspace_untouched[key]
    elif tracker.cuda_workspaces:
        # mkldnn_rnn_layer(input, w0..w3, hx, cx, reverse, batch_sizes, mode, hidden_size, num_layers, has_biases, ...)
        reserve, forward_scratch, _ = _cudnn_rnn_sizes(tracker, args[:7], hidden=args[10], mode=args[9],
                                                       has_biases=args[12])
        if reserve != workspace.nbytes:
            workspace = torch.empty(reserve, dtype=torch.uint8, device=workspace.device)
            out = (*out[:3], workspace)
        # cuDNN's forward workspace: taken after the outputs and the reserve, freed inside the op
        tracker.track(workspace)
        for t in out[:3]:
            tracker.track(t)
        tracker.scratch(forward_scratch)
        return out
    # recorded first whether sized or not, so two traces' allocations come in the same order (batchmodel.py)
    tracker.track(workspace, untouched=untouched)
    return out


# op -> for each of its outputs, the index of the first output sharing its storage: ops whose kernel returns one
# tensor in two places (mkldnn_rnn_layer_backward's two bias gradients), seen where FakeTensorMode ran the kernel
_OUTPUT_ALIASES: dict[Any, tuple[int, ...]] = {}


def _aliased_as_the_kernel(func: Any, out: tuple) -> tuple:
    """`out` with the outputs the kernel returns as one tensor made one tensor again. FakeTensorMode's dispatch
    cache rebuilds a cached op's outputs as separate tensors; the kernel (run on a cache miss) returns one tensor
    twice, and autograd then clones it for one of the two gradients it feeds. Whether an op's shapes had run
    before in the process (tiny-lstm traced after others: one allocation came later at batch 4 than at 2,
    and batchmodel.py could not match the two traces) would otherwise change the trace."""
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


# cuDNN's and ideep's enum for an LSTM (cudnnRNNMode_t CUDNN_LSTM; ideep::rnn_kind::LSTM), the one RNN
# kind that takes the CPU's mkldnn_rnn_layer path
_LSTM_MODE = 2


def _cudnn_rnn_sizes(tracker: _Tracker, tensors: tuple, hidden: int, mode: int,
                     has_biases: bool) -> tuple[int, int, int]:
    """cuDNN's LSTM on this machine's GPU (the target) for one layer of the shapes the CPU trace runs
    per layer (`tensors`, the first seven arguments of mkldnn_rnn_layer and of its backward: input
    (T, B, I), its four weights, h0 and c0 (B, H)): (reserve space bytes, forward workspace bytes,
    backward workspace bytes). The reserve space is kept from forward to backward, where the CPU's
    fake op keeps a workspace of 0 bytes; the workspaces come from the caching allocator inside each
    op and are freed before it returns. Measured by running `_cudnn_rnn` and `_cudnn_rnn_backward`
    once on zeros, each workspace as the allocator's peak over what its op leaves allocated
    (`_cuda_scratch_of`), cached as one probed shape (`_probed_blocks`); 0 for what cannot run here
    (the trace then counts none of it, as on other targets). A real multi-layer LSTM runs all layers
    in one cuDNN call, whose reserve space also holds the layers' outputs the CPU trace keeps as
    tensors: taken per layer, the estimate counts those (L - 1) outputs twice."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if mode != _LSTM_MODE:
        return 0, 0, 0
    inp, weights, hx, cx = tensors[0], tensors[1:5], tensors[5], tensors[6]
    key = _probe_key(torch.ops.aten._cudnn_rnn.default, tensors)

    def size() -> tuple[int]:  # the reserve space; all three sizes go to tracker.rnn_sizes
        tf32, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, tracker.cudnn_tf32
        sizes = (0, 0, 0)
        with unset_fake_temporarily():
            try:
                def zeros(t: Any, shape: tuple | None = None) -> Any:
                    return torch.zeros(shape or t.shape, dtype=inp.dtype, device="cuda")

                x = zeros(inp)
                w = [zeros(t) for t in (weights if has_biases else weights[:2])]
                h0, c0 = zeros(hx, (1, *hx.shape)), zeros(cx, (1, *cx.shape))
                flat = dict(weight_stride0=len(w), mode=mode, hidden_size=hidden, proj_size=0, num_layers=1,
                            batch_first=False, dropout=0.0, train=True, bidirectional=False, batch_sizes=[],
                            dropout_state=None)
                out, forward = _cuda_scratch_of(lambda: torch.ops.aten._cudnn_rnn(x, w, weight_buf=None, hx=h0,
                                                                                  cx=c0, **flat))
                sizes = (int(out[3].nbytes), forward, 0)
                grad_out = torch.zeros_like(out[0])
                _, backward = _cuda_scratch_of(lambda: torch.ops.aten._cudnn_rnn_backward(
                    x, w, weight_buf=out[4], hx=h0, cx=c0, output=out[0], grad_output=grad_out, grad_hy=None,
                    grad_cy=None, reserve=out[3], output_mask=[True, True, True, True], **flat))
                sizes = (*sizes[:2], backward)
            except Exception:  # noqa: BLE001 - no cuDNN or no room on the GPU now: what was sized stays, never a failed trace
                pass
            finally:
                torch.backends.cudnn.allow_tf32 = tf32
        tracker.rnn_sizes[key] = sizes
        return sizes[:1]

    _probed_blocks(tracker, torch.ops.aten._cudnn_rnn.default, tensors, {}, False, size)
    return tracker.rnn_sizes.get(key, (0, 0, 0))  # absent: inputs past PROBE_INPUT_LIMIT


def _cuda_scratch_of(call: Callable[[], Any]) -> tuple[Any, int]:
    """(call()'s result, the scratch it took on the GPU: the caching allocator's peak during the call
    over what stays allocated after it, its result included)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    result = call()
    torch.cuda.synchronize()
    return result, max(0, torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated())


def _cudnn_rnn_backward_scratch(tracker: _Tracker, args: tuple, out: Any) -> Any:
    """cuDNN's backward workspace for the layer `args` (mkldnn_rnn_layer_backward's, whose first seven
    arguments are its forward's), after the op's outputs (see `_cudnn_rnn_sizes`)."""
    from torch.utils._pytree import tree_flatten

    for t in tree_flatten(out)[0]:
        tracker.track(t)
    # mkldnn_rnn_layer_backward(input, w0..w3, hx, cx, output, hy, cy, grad_output, grad_hy, grad_cy, reverse,
    #                           mode, hidden_size, num_layers, has_biases, ...)
    tracker.scratch(_cudnn_rnn_sizes(tracker, args[:7], hidden=args[15], mode=args[14], has_biases=args[17])[2])
    return out


# A real probe of one op allocates its inputs, outputs and scratch; past this many input bytes
# the op is left unsized (its scratch then counts as nothing, as on other targets).
PROBE_INPUT_LIMIT = 1 << 30


def _probe_key(func: Any, args: tuple, kwargs: dict | None = None,
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


def _real_like(args: Any, device: str = "cpu", entries: Callable[[Any], int] | None = None) -> Any:
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


def _affordable(args: Any, nbytes: Callable[[Any], int] | None = None) -> bool:
    """Whether a probe's inputs (`nbytes(t)` each, else the tensor's own) stay within PROBE_INPUT_LIMIT."""
    import torch
    from torch.utils._pytree import tree_flatten

    size = nbytes or (lambda a: a.nbytes)
    return sum(size(a) for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)) <= PROBE_INPUT_LIMIT


def _sparse_op(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the op takes a sparse COO tensor (and no other non-strided one): its CPU kernel may hold
    buffers inside itself that no dispatch shows, fake or real, which a real run on an input of as many
    entries measures (`_real_scratch`). torch.sparse.mm's (`_sparse_addmm`) holds a buffer of its output's
    size beside the output: a small GCN's live peak, measured from the profiler's events, was one such
    buffer above both its fake and real traces (3.51 against 3.26 MB, session 51)."""
    import torch
    from torch.utils._pytree import tree_flatten

    if func.namespace != "aten" or func.is_view or torch.Tag.nondeterministic_seeded in func.tags:
        return False
    layouts = {a.layout for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
    return torch.sparse_coo in layouts and layouts <= {torch.sparse_coo, torch.strided}


@functools.lru_cache(maxsize=1)
def _stride_ops() -> tuple[frozenset, frozenset]:
    """(ops that take any strides or are the copy themselves, matrix products that take either unit stride)."""
    import torch

    aten = torch.ops.aten
    copies = frozenset({aten._to_copy.default, aten.copy_.default, aten.clone.default})
    products = frozenset({aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.addbmm})
    return copies, products


def _may_copy_strided(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the op's CPU kernel may copy a strided input to a contiguous buffer inside itself (ATen's
    `.contiguous()` and `expect_contiguous()`, e.g. softmax's backward on the transposed gradient of
    an attention product): an allocation dispatch never shows, fake or real, which only a real run of
    the op on the same strides measures (`_real_scratch`). Candidates: an op that is not a view, not
    pointwise (TensorIterator walks any strides), not seeded (a probe would draw from the RNG), with
    a non-contiguous tensor input of any size; a matrix product only where such an input has no unit
    stride in its last two dimensions (BLAS takes either). No size threshold: one that grows with the
    batch crosses it between the batch model's two traces, which then make different allocations and
    cannot be extrapolated per allocation (batchmodel.py). vit-b16 at 112 px, bf16 adamw b16, with a
    1 MiB threshold: 3 op shapes probed at 16, 1 at 8; extrapolated to batch 2, the long-lived peak
    came out 1564 MiB instead of 1319, the resident-set fit's slope fell to its floor and the estimate
    to -13.1% of the measured resident set (bench grid, session 28)."""
    import torch
    from torch.utils._pytree import tree_flatten

    skip = (torch.Tag.pointwise, torch.Tag.nondeterministic_seeded, torch.Tag.inplace_view)
    if func.namespace != "aten" or func.is_view or any(tag in func.tags for tag in skip):
        return False
    copies, products = _stride_ops()
    if func in copies:
        return False
    tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
    if any(a.layout != torch.strided for a in tensors):  # a sparse op: probed as one (`_sparse_op`)
        return False
    strided = [a for a in tensors if not a.is_contiguous()]
    if func.overloadpacket in products:
        strided = [a for a in strided if 1 not in a.stride()[-2:]]
    return bool(strided)


@functools.lru_cache(maxsize=1)
def _cublas_ops() -> frozenset:
    """aten ops whose CUDA kernels are cuBLAS calls (matrix products; `linear` and `matmul` reach dispatch as
    these), so the thread that runs one takes a cuBLAS handle and its workspace. Convolutions (cuDNN), attention
    kernels (flash, memory-efficient) and cuDNN's RNN do not."""
    import torch

    aten = torch.ops.aten
    return frozenset({aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.addbmm, aten.mv, aten.addmv, aten.dot,
                      aten.vdot, aten._addmm_activation, aten._scaled_mm, aten._int_mm})


def _runs_on_cublaslt(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether torch's CUDA kernel for this matrix product goes through cuBLASLt (which takes a workspace of
    its own): addmm and _addmm_activation adding a bias vector with beta 1 (`linear` with a bias), and the
    scaled (fp8) products."""
    import torch

    aten = torch.ops.aten
    if func.overloadpacket is aten._scaled_mm:
        return True
    return (func in (aten.addmm.default, aten._addmm_activation.default) and isinstance(args[0], torch.Tensor)
            and args[0].dim() == 1 and kwargs.get("beta", 1) == 1)


@functools.lru_cache(maxsize=1)
def _scratch_ops() -> frozenset:
    """CPU kernels that allocate scratch inside themselves through torch's allocator (oneDNN's)."""
    import torch

    aten = torch.ops.aten
    return frozenset({aten.mkldnn_rnn_layer_backward.default, aten.convolution.default,
                      aten.convolution_backward.default})


def _half_product(func: Any, args: tuple, dtypes: frozenset) -> bool:
    """Whether the op is a matrix product of 16-bit floats (bf16, fp16: autocast's linear layers and attention)
    of a dtype in `dtypes`, those whose products hold a buffer beside their output on this CPU
    (`_products_holding_scratch`).
    Their CPU kernel may take scratch inside itself through torch's allocator: oneDNN's matmul on a CPU with
    AMX (an Intel Xeon reported as family 6 model 207, session 54) holds a float32 buffer of the output's size
    or more beside it. bf16 (32, 10) x (10, 8192), a linear layer's input gradient: 1058432 bytes beside the
    512 KiB output; fp16 (512, 768) x (768, 768): 2.9 MB beside 768 KiB; float32 products hold none. A lazy
    conv net's bf16 live peak was 371096 bytes over its trace there, at that product (tests/advisor/
    lazy_convnet.py), where a Zen 5 CPU's matched it. A Zen 4 CPU (family 25 model 17, avx512_bf16 without
    AMX; session 55) holds a little: the same bf16 product 26240 bytes over its output, bf16 (512, 768) x
    (768, 768) 263808 bytes, (2048, 768) x (768, 3072) about as much; its fp16 products none. AMX's
    scratch is not affine in the batch (largest.py)."""
    import torch

    products = _stride_ops()[1]
    return func.overloadpacket in products and isinstance(args[0], torch.Tensor) and args[0].dtype in dtypes


# A 16-bit dtype's matrix products are probed where one of this CPU's holds scratch of at least this share of its
# output beside it (`_products_holding_scratch`): a buffer that grows with the output, as AMX's float32 one does
PRODUCT_SCRATCH_SHARE = 0.5


@functools.cache
def _products_holding_scratch(share: float) -> frozenset:
    """The 16-bit dtypes whose matrix products hold scratch of at least `share` of their output beside it on this
    CPU, from one small product each under the profiler (bf16 (32, 10) x (10, 8192): a few milliseconds). Only
    theirs are probed, as the probes cost a real run of every product shape and, where they find scratch, the
    largest batch is searched again on exact traces (largest.py). A Zen 4 (session 55) holds 26240 bytes beside
    that bf16 product's 512 KiB and about the same 258 KiB beside larger ones, a buffer that does not grow with
    them; probed, gpt2-small b4's uncalibrated bf16 estimate took 21.4 s against 4.9 s for no change in its
    answer. It holds nothing beside its fp16 products and runs them slowly, (2048, 768) x (768, 3072) in 10.4 s
    against bf16's 0.03 s: probing them ran gpt2-small b4's fp16 trace past ten minutes. An AMX Xeon holds a
    float32 buffer of about the output's size beside this bf16 product (session 54; its fp16 products were
    measured at (512, 768) x (768, 768) only, 2.9 MB beside 768 KiB)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from advisor.measure import memory_events

    holding = set()
    for dtype in (torch.bfloat16, torch.float16):
        a, b = torch.zeros(32, 10, dtype=dtype), torch.zeros(10, 8192, dtype=dtype)
        with _stderr_to_devnull(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = torch.mm(a, b)
            del out
        scratch = sum(n for n in memory_events(prof) if n > 0) - 32 * 8192 * dtype.itemsize
        if scratch > 0 and scratch >= share * 32 * 8192 * dtype.itemsize:
            holding.add(dtype)
    return frozenset(holding)


def _cpu_reduction(func: Any) -> bool:
    """Whether the op is a reduction, whose CPU kernel may allocate inside themselves through torch's allocator: a mean over a
    16-bit float input sums a float32 copy of it, twice the input's bytes (measured here: bf16 and fp16 alike,
    over all dimensions or some; a sum does not copy), and logsumexp holds a buffer of its input's size in any
    dtype. The hypernetwork of bench/workloads/fresh8.py, bf16 adamw, pools (batch, 256, 128) activations with
    a mean: its live peak was 10.6 MiB over the trace at batch 128, the float32 copy raising it, and exact at 96,
    where the copy fell at a lower moment of the step."""
    import torch

    return is_reduction(func) or func is torch.ops.aten.logsumexp.default


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


def _real_scratch(tracker: _Tracker, func: Any, args: tuple, kwargs: dict | None = None, copy: bool = False,
                  reduction: bool = False, product: bool = False) -> None:
    """A kernel that allocates scratch inside itself (oneDNN's convolutions and RNN backward, sized by
    the algorithm it picks for this CPU and shape; a contiguous copy of a strided input,
    `_may_copy_strided`; a reduction's, `_cpu_reduction`; a sparse op's, `_sparse_op`): run it once on
    real zeros of the same strides (a sparse input with as many entries as the trace holds, `_real_sparse`)
    under the profiler, and record two fake allocations of the scratch's size that die at once
    (`_scratch_blocks`: its largest block and the rest), so the trace's peak sees it beside the op's outputs.
    `copy`: probed for a contiguous copy (counted apart, Trace.probed_copies). The scratch is the probe's peak
    over what it held before (its outputs counted in it), or, `reduction` (counted apart,
    Trace.probed_reductions), over the outputs it leaves: a reduction's output, which the trace holds already,
    can be as large as its input where the reduced dimension is short. `product`: a 16-bit matrix product
    (`_half_product`; counted apart, Trace.probed_products)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
    from torch.profiler import ProfilerActivity, profile
    from torch.utils._pytree import tree_flatten

    from advisor.measure import memory_events

    kwargs = kwargs or {}
    if not any(isinstance(a, FakeTensor) for a in tree_flatten((args, kwargs))[0]):
        return

    def blocks() -> tuple[int, int]:
        with unset_fake_temporarily():
            try:
                real, real_kwargs = _real_like((args, kwargs), entries=tracker.entries_of)
                with _stderr_to_devnull(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                    outputs = func(*real, **real_kwargs)
                    if not reduction:
                        del outputs
                return _scratch_blocks(memory_events(prof))
            except Exception:  # noqa: BLE001 - no kernel for this here: nothing to size, and a probe never fails the trace
                return 0, 0

    tracker.scratch(*_probed_blocks(tracker, func, args, kwargs, copy, blocks, reduction, count=2, product=product))


def _scratch_blocks(events: list[int]) -> tuple[int, int]:
    """A probe's scratch from its allocator's events in order (bytes allocated +, freed -): the peak of their
    running sum over where it ends, as (the largest block live at the peak that is freed by the end, the rest).
    In the kernel's own sizes, so that a calibration run's heap log, which requests them, is resized with the
    trace (heaplog.rescaled). A mean over bf16 (16, 256, 128) on this CPU allocates 8 KiB and a float32 copy of
    2 MiB; one block of their sum, 2105344 bytes, was a size the run's log never requests, and its replay at
    batch 128 kept the run's 2 MiB where the kernel takes 16 (bench/workloads/fresh8.py's hypernetwork). Frees
    are paired with the last live allocation of their size (the events carry no addresses)."""
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


def _probed_blocks(tracker: _Tracker, func: Any, args: tuple, kwargs: dict, copy: bool,
                   blocks: Callable[[], tuple[int, ...]], reduction: bool = False, count: int = 1,
                   product: bool = False) -> tuple[int, ...]:
    """The scratch of one op shape, `count` blocks measured by `blocks()` the first time it is seen (cached by
    `_probe_key`); 0 bytes each where its inputs are past PROBE_INPUT_LIMIT. `copy`, `reduction`, `product`:
    see `_real_scratch`."""
    if not _affordable((args, kwargs), tracker.bytes_of):
        return (0,) * count
    key = _probe_key(func, args, kwargs, tracker.entries_of)
    if copy:
        tracker.copy_probes.add(key)
    if reduction:
        tracker.reduction_probes.add(key)
    if product:
        tracker.product_probes.add(key)
    if key not in tracker.probed:
        tracker.probed[key] = tuple(blocks())
    return tracker.probed[key]


@functools.lru_cache(maxsize=1)
def _cudnn_ops() -> frozenset:
    """Ops that run on cuDNN on a CUDA target, with a workspace (and an LSTM's reserve space) whose size
    follows the algorithm cuDNN picks on the device (the CPU trace runs oneDNN's LSTM layer by layer)."""
    import torch

    aten = torch.ops.aten
    return frozenset({aten.convolution.default, aten.convolution_backward.default, aten.mkldnn_rnn_layer.default,
                      aten.mkldnn_rnn_layer_backward.default})


@functools.lru_cache(maxsize=1)
def _cuda_scratch_ops() -> frozenset:
    """Ops whose CUDA kernels take scratch from the caching allocator inside the op: cuDNN's
    convolutions (a workspace whose size comes from the algorithm cuDNN picks for the GPU, shape and
    dtype), and reductions, whose kernel (gpu_reduce_kernel) takes a buffer for partial results where
    it splits each output over several blocks (its size follows the launch configuration torch picks
    for the GPU and shape: seen on an H100, 64 MiB for the bias gradient of a 2048-wide linear layer at
    batch 4096, a sum over 32 MiB in fp32 and over 16 MiB in bf16 alike)."""
    import torch

    aten = torch.ops.aten
    reductions = {aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim, aten.nansum.default,
                  aten.prod.default, aten.prod.dim_int, aten.amax.default, aten.amin.default, aten.max.dim,
                  aten.min.dim, aten.argmax.default, aten.argmin.default, aten.linalg_vector_norm.default,
                  aten.var.correction, aten.std.correction, aten.var_mean.correction, aten.std_mean.correction,
                  aten.any.dim, aten.all.dim}
    return frozenset({aten.convolution.default, aten.convolution_backward.default, *reductions})


def _cuda_scratch(tracker: _Tracker, func: Any, args: tuple, kwargs: dict, out: Any, copy: bool = False) -> Any:
    """cuDNN's convolution workspace, a reduction's buffer (`_cuda_scratch_ops`) or a kernel's contiguous
    copy of a strided input (`_may_copy_strided`), which the CPU's fake ops know nothing of: run the op
    once on zeros of the same shapes, strides and dtypes on this machine's GPU (the target) and take
    the allocator's peak over what the op leaves allocated (its outputs). The workspace is taken after
    the outputs and freed before the op returns, so the trace records the outputs, then a fake
    allocation of the workspace's size that dies at once. `copy`: as in `_real_scratch`."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
    from torch.utils._pytree import tree_flatten

    if not any(isinstance(a, FakeTensor) for a in tree_flatten((args, kwargs))[0]):
        return out

    def size() -> tuple[int]:
        tf32, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, tracker.cudnn_tf32  # as training sets it
        with unset_fake_temporarily():
            try:
                real, real_kwargs = _real_like((args, kwargs), "cuda")
                return (_cuda_scratch_of(lambda: func(*real, **real_kwargs))[1],)
            except Exception:  # noqa: BLE001 - no kernel or no room for it on the GPU now: nothing sized, never a failed trace
                return (0,)
            finally:
                torch.backends.cudnn.allow_tf32 = tf32

    n = _probed_blocks(tracker, func, args, kwargs, copy, size)
    for t in tree_flatten(out)[0]:
        tracker.track(t)
    tracker.scratch(*n)
    return out


def _reduction_scratch(tracker: _Tracker, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """A reduction on a CUDA target not at hand: after its outputs, the blocks its kernel holds while it runs
    (`cuda_reduce.scratch_slots`, from torch's launch rules and the GPU's multiprocessors: partial results and
    semaphores, and an accumulation buffer before them for a huge 16-bit one), freed as it returns, the last
    taken first. All three are recorded for every reduction, 0 bytes where it takes none, so that two traces'
    allocations keep their order (batchmodel.py)."""
    from torch.utils._pytree import tree_flatten

    for t in tree_flatten(out)[0]:
        tracker.track(t)
    spec = reduction_spec(func, args, kwargs, out)
    sizes = scratch_slots(spec, tracker.reduce_gpu) if spec is not None else (0, 0, 0)
    if any(sizes):
        tracker.reduce_scratch.add(spec)
    for slot, aid in enumerate(tracker.scratch(*sizes)):
        if spec is not None:
            tracker.reduce_specs.append((aid, slot, spec))
    return out


def _moved_to_device(obj: Any, tracker: _Tracker) -> Any:
    """What `.to("cuda")` puts on the device, recorded in its order; returns the batch on the device (a module
    stays as it is). A module's parameters and buffers as `Module._apply` walks them (each child's first, depth
    first, then its own parameters, then its buffers), each storage once: a weight tied to another is moved
    with it. A batch's tensors in pytree order, each copied (two views of one CPU tensor are two copies).
    Nothing made on the CPU before is on the device: an initializer's scratch, or a tied layer's own weight,
    replaced in its constructor."""
    import torch
    from torch.utils._pytree import tree_map

    if isinstance(obj, torch.nn.Module):
        def walk(m: torch.nn.Module) -> None:
            for child in m.children():
                walk(child)
            for t in (*m._parameters.values(), *m._buffers.values()):
                tracker.track(t)

        walk(obj)
        return obj
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, obj)


def _data_dependent(exc: BaseException) -> bool:
    """Whether `exc` is fake tensors refusing an op whose output shape or result depends on a tensor's
    values (nonzero, repeat_interleave with tensor repeats, int() of a tensor)."""
    return any(word in type(exc).__name__ for word in ("DataDependent", "DynamicOutputShape"))


def build_batch(workload: Workload, batch_size: int, fake_mode) -> Any:
    """The workload's batch: under `fake_mode`, built there where its code lets it, else built for real
    outside it and made fake (`_fakeify`). A make_batch that reads values to build its tensors (a graph
    batch's node-to-graph index by repeat_interleave of the graphs' sizes, a packed sequence's positions)
    then costs its batch in real memory, the inputs only, and not a real-step fallback for the whole
    model: bench/workloads/fresh5.py:mpnn, whose model runs on fake tensors, fell back to real steps at
    batch 1 and 2 for its make_batch's repeat_interleave (session 49)."""
    if fake_mode is None:
        return workload.make_batch(batch_size)
    try:
        batch = workload.make_batch(batch_size)
    except Exception as exc:  # noqa: BLE001 - only a data-dependent refusal is retried; the rest re-raised
        if not _data_dependent(exc):
            raise
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            batch = workload.make_batch(batch_size)
    return _fakeify(batch, fake_mode)


def _fakeify(batch: Any, fake_mode) -> Any:
    """Real tensors a make_batch built outside dispatch (e.g. from numpy) become fake ones."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_map

    def conv(x):
        if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor):
            return fake_mode.from_tensor(x)
        return x

    return tree_map(conv, batch)


def _replay(tracker: _Tracker) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """(curve, signed sizes, allocation ids, signed untouched bytes or None) of the tracker's events."""
    labels = np.asarray(tracker.labels, dtype=np.int64)
    nbytes = np.asarray(tracker.nbytes, dtype=np.int64)
    ev = np.asarray(tracker.events, dtype=np.int64)
    ids = np.abs(ev) - 1
    signed = np.where(ev > 0, nbytes[ids], -nbytes[ids])
    onehot = np.zeros((len(ev), len(CATEGORY_NAMES)), dtype=np.int64)
    onehot[np.arange(len(ev)), labels[ids]] = signed
    untouched = None
    if tracker.untouched:
        per_alloc = np.zeros(len(nbytes), dtype=np.int64)
        per_alloc[list(tracker.untouched)] = list(tracker.untouched.values())
        untouched = np.where(ev > 0, per_alloc[ids], -per_alloc[ids])
    return np.cumsum(onehot, axis=0), signed, ids, untouched


class _BuildReadsValues(Exception):
    """The model's build read a fake tensor's value (`_build`)."""


_INIT_SKIPPED = threading.Lock()  # one skipped build at a time: the module's attributes are process-wide


@contextlib.contextmanager
def _initializers_skipped():
    """torch.nn.init's in-place initializers (trunc_normal_, kaiming_uniform_, ...) as no-ops that hand back
    their tensor, for as long as one fake build takes: modules' reset_parameters and users' init code call
    them through the module. A real model built in another thread meanwhile would be left uninitialized;
    the estimator builds none (trials and calibration runs are processes of their own)."""
    import torch.nn.init as init

    names = [n for n in dir(init) if n.endswith("_") and not n.startswith("_") and callable(getattr(init, n))]

    def keep(tensor, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003 - any initializer's signature
        return tensor

    with _INIT_SKIPPED:
        saved = {n: getattr(init, n) for n in names}
        try:
            for n in names:
                setattr(init, n, keep)
            yield
        finally:
            for n, f in saved.items():
                setattr(init, n, f)


_CONVERTING = threading.local()  # `_fake_conversions`: set in the thread whose fake trace is running


@contextlib.contextmanager
def _fake_conversions():
    """nn.Module.to/.half()/.bfloat16() and a memory format (`_apply`) on fake parameters, as on real ones:
    torch 2.13 swaps a fake parameter with its converted copy (torch.utils.swap_tensors), and the swap
    refuses a tensor that a weak reference points to, which fake ones have, so every such conversion
    raised. The estimator's own pure-bf16 cast (advisor.training.prepare) was one: every bf16-pure estimate
    fell back to real steps, which a model with BatchNorm fails at batch 1; a build calling `.half()` was
    another. While this thread traces, a swap of two fake tensors sets the parameter's data to the copy's
    instead, what `_apply` does to real ones (the parameter object kept, its old storage freed); any other
    swap, and every swap in other threads, goes torch's way."""
    import torch
    import torch.utils
    from torch._subclasses.fake_tensor import FakeTensor

    with _INIT_SKIPPED:  # installed once in the process
        if not getattr(torch.utils.swap_tensors, "_advisor_fake_data", False):
            original = torch.utils.swap_tensors

            def swap(t1, t2):  # noqa: ANN001, ANN202 - torch.utils.swap_tensors' signature
                if getattr(_CONVERTING, "on", False) and isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor):
                    with torch.no_grad():
                        t1.data = t2.data
                    return None
                return original(t1, t2)

            swap._advisor_fake_data = True
            torch.utils.swap_tensors = swap
    _CONVERTING.on = True
    try:
        yield
    finally:
        _CONVERTING.on = False


@contextlib.contextmanager
def _distribution_checks_off():
    """torch.distributions' argument checks off for a fake trace, as `Distribution.set_default_validate_args(False)`
    sets them: each checks its parameters' values (`if not valid.all(): raise`), which fake tensors do not have,
    so a VAE, a policy or a flow that builds a Normal (validating by default) fell back to real steps for the
    whole model. A check allocates a boolean per element while it runs and changes nothing else; one given
    validate_args=True still checks, and still falls back. Process-wide while it lasts, as the initializers'
    skip is: a distribution made in another thread meanwhile goes unchecked, and another thread's fake trace
    waits for this one (Python's lock on the interpreter runs one at a time anyway)."""
    from torch.distributions import Distribution

    with _VALIDATION:
        saved = Distribution._validate_args
        Distribution.set_default_validate_args(False)
        try:
            yield
        finally:
            Distribution.set_default_validate_args(saved)


_VALIDATION = threading.RLock()  # a trace within a trace in one thread would not wait on itself


def _build(workload: Workload, fake_mode: Any, skip_init: bool) -> Any:
    """`workload.build_model()`, its tensors made this fake mode's (`_adopt_copies`) where it is one; on
    fake tensors, a build that reads a tensor's value raises _BuildReadsValues for `trace_training` to
    build again with the initializers skipped."""
    try:
        with _initializers_skipped() if skip_init else contextlib.nullcontext(), warnings.catch_warnings():
            # copy.deepcopy of a fake parameter asks for its data pointer (torch/_tensor.py): torch's warning
            # is about that check, not the user's code
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            fake = fake_mode is not None
            with (_fresh_copies() if fake else contextlib.nullcontext(),
                  _lazy_on_fake() if fake else contextlib.nullcontext()):
                model = workload.build(lambda n: build_batch(workload, n, fake_mode))
    except Exception as exc:
        if fake_mode is not None and not skip_init and "DataDependent" in type(exc).__name__:
            raise _BuildReadsValues(str(exc)) from exc
        raise
    return _adopt_copies(model, fake_mode) if fake_mode is not None else model


@contextlib.contextmanager
def _lazy_on_fake() -> Any:
    """For the build on fake tensors: lazy modules (nn.LazyLinear, LazyConv2d, LazyBatchNorm2d, ...). torch 2.13
    cannot make their uninitialized parameters and buffers over a fake tensor (UninitializedParameter's
    `_make_subclass` raises on one), and a materialized one keeps the real object, which cannot become fake; the
    estimate fell back to real steps for any model with one. Here each is made real and empty (no bytes) until
    the module's first forward (`Workload.build` runs one on a batch of 2), where the shape it infers is made a
    fake tensor of the trace's mode and put in the module's table in its place. Outside a lazy module's first
    forward in this build, torch's own `materialize` runs. Process-wide while it lasts, under the lock that
    `_distribution_checks_off` takes: another thread's fake trace waits."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.nn.modules.lazy import LazyModuleMixin
    from torch.nn.parameter import UninitializedBuffer, UninitializedParameter, UninitializedTensorMixin

    new_param, new_buffer = UninitializedParameter.__new__, UninitializedBuffer.__new__
    materialize, infer = UninitializedTensorMixin.materialize, LazyModuleMixin._infer_parameters
    inferring: list[Any] = []  # the lazy modules whose first forward is running, innermost last

    def made_real(new: Callable[..., Any]) -> Callable[..., Any]:
        def make(cls: type, *args: Any, **kwargs: Any) -> Any:
            with unset_fake_temporarily():
                return new(cls, *args, **kwargs)
        return make

    def fake_in_place(self: Any, shape: Any, device: Any = None, dtype: Any = None) -> None:
        owner = inferring[-1] if inferring else None
        tables = (owner._parameters, owner._buffers) if owner is not None else ()
        found = next(((t, k) for t in tables for k, v in t.items() if v is self), None)
        if found is None:
            return materialize(self, shape, device, dtype)
        with unset_fake_temporarily():
            device, dtype = device or self.device, dtype or self.dtype
        made = torch.empty(shape, device=device, dtype=dtype)
        table, name = found
        table[name] = torch.nn.Parameter(made, requires_grad=self.requires_grad) \
            if isinstance(self, UninitializedParameter) else made

    def first_forward(self: Any, module: Any, args: Any, kwargs: Any = None) -> Any:
        inferring.append(module)
        try:
            return infer(self, module, args, kwargs)
        finally:
            inferring.pop()

    with _VALIDATION:
        UninitializedParameter.__new__, UninitializedBuffer.__new__ = made_real(new_param), made_real(new_buffer)
        UninitializedTensorMixin.materialize, LazyModuleMixin._infer_parameters = fake_in_place, first_forward
        try:
            yield
        finally:
            UninitializedParameter.__new__, UninitializedBuffer.__new__ = new_param, new_buffer
            UninitializedTensorMixin.materialize, LazyModuleMixin._infer_parameters = materialize, infer


def _fresh_copies() -> Any:
    """A torch function mode for the build on fake tensors: `copy.deepcopy` of a fake tensor makes an empty
    one of the trace's mode with its shape, strides, dtype and requires_grad (values are not traced), where
    torch's own deep copy of a plain tensor tries to copy its storage. For a fake tensor made from data, as
    `torch.tensor(0)` makes BatchNorm's num_batches_tracked, that raised, and left glibc's heap corrupt (the
    next trace in the process aborted): a deep copy of any module holding a BatchNorm failed, the momentum
    encoder of MoCo, BYOL or DINO, a model's EMA copy (bench/workloads/fresh7.py:moco fell back to real steps
    for it). A parameter's copy is a parameter."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.overrides import TorchFunctionMode

    class FreshCopies(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is not torch.Tensor.__deepcopy__ or not isinstance(args[0], FakeTensor):
                return func(*args, **(kwargs or {}))
            t, memo = args
            new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            if isinstance(t, torch.nn.Parameter):  # a fake parameter is a FakeTensor marked as one
                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
            elif t.requires_grad:
                new.requires_grad_()
            memo[id(t)] = new
            return new

    return FreshCopies()


def _adopt_copies(model: Any, fake_mode: Any) -> Any:
    """The model's parameters and buffers that belong to another fake mode, as fake tensors of this one.
    copy.deepcopy of a module on fake tensors made them so (torch 2.13: FakeTensor.__deepcopy__) until
    `_fresh_copies` made its copies in the trace's mode (since then none is left to adopt there: a build
    can still keep one from an earlier trace, a buffer from a module-level cache); nn.TransformerEncoder
    and Decoder deep-copy their layer, and an op on such a tensor converts it afresh,
    with a storage of its own each time, which the trace took for a new allocation at every use (the
    fresh3 set's CTC model, 72 of its 80 parameters: allocated +4.6% against the real peak). Each is
    replaced by an empty tensor of this mode with its shape, strides and dtype (values are not traced),
    made in the trace's mode so it is tracked, the old one freed; a tensor shared by several modules
    stays shared."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    adopted: dict[int, Any] = {}

    def own(t: Any) -> Any:
        if not isinstance(t, FakeTensor) or t.fake_mode is fake_mode:
            return t
        if id(t) not in adopted:
            new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            adopted[id(t)] = torch.nn.Parameter(new, requires_grad=t.requires_grad) \
                if isinstance(t, torch.nn.Parameter) else new
        return adopted[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                table[name] = own(t)
    return model


def trace_training(workload: Workload, batch_size: int, **kwargs: Any) -> Trace:
    """Build `workload` and run two full training steps, recording memory (`_trace_training`). A build
    that reads a tensor's value, which fake tensors do not have, is traced again from the start with
    torch.nn.init's initializers as no-ops (`Trace.init_skipped`): initial values change no memory, and
    the commonest such read is an initializer's, trunc_normal_'s rejection loop in torch 2.13 (`if not
    mask.any()`), which torchvision's Swin and ConvNeXt and many ViTs call. A build that still reads a
    value is an EstimateError, as a step that does."""
    try:
        return _trace_training(workload, batch_size, **kwargs)
    except _BuildReadsValues:
        return replace(_trace_training(workload, batch_size, skip_init=True, **kwargs), init_skipped=True)


def _trace_training(workload: Workload, batch_size: int, *, precision: Precision, optimizer: OptimizerKind,
                    checkpointing: bool = False, fused_backward: bool = False, optimizer_impl: str | None = None,
                    fake: bool = True, count_flops: bool = True, cpu_workspaces: bool = False,
                    cuda_workspaces: bool = False, device: str = "cpu", reduce_gpu: ReduceGpu | None = None,
                    skip_init: bool = False) -> Trace:
    """Build `workload` and run two full training steps, recording memory.

    fake=True (the estimator): on fake tensors, nothing allocated. fake=False: on real CPU
    tensors, so real kernels choose their own paths (e.g. oneDNN's RNN with its workspace);
    the calibration runs this at small batch sizes in a fresh process. cpu_workspaces (this CPU
    is the target, fake tensors): the workspaces and scratch of oneDNN's kernels, which fake ops
    leave out, are sized by running each such op once on real zeros (`_with_real_workspace`,
    `_real_scratch`). cuda_workspaces (this machine's GPU is the target, fake tensors): cuDNN's
    convolution workspaces, sized the same way on the GPU (`_cuda_scratch`). device "cuda" (a CUDA
    target): the run is DESIGN.md's, `build_model().to("cuda")` and each batch made on the CPU and moved, so
    only what is moved is on the device, in the order it is moved (`_moved_to_device`); and autocast's
    regions follow CUDA's op rules, not the CPU's (`autocast_cuda.cuda_policy`). reduce_gpu (a CUDA target
    whose kernels are not sized on this machine, fake tensors): each reduction's cross-block scratch is worked
    out for that GPU (`_reduction_scratch`).
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from advisor.training import prepare, repeated_blocks, train_step

    t0 = time.perf_counter()
    tracker = _Tracker()
    tracker.cpu_workspaces = cpu_workspaces and fake
    if tracker.cpu_workspaces:  # a float32 workload may still run 16-bit products of its own
        tracker.scratch_products = _products_holding_scratch(PRODUCT_SCRATCH_SHARE)
    tracker.cuda_workspaces = cuda_workspaces and fake
    tracker.cudnn_tf32 = precision == Precision.tf32  # advisor.training.set_matmul_precision's switch
    tracker.reduce_gpu = reduce_gpu if fake and device == "cuda" and not tracker.cuda_workspaces else None
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    try:
        # the cuDNN LSTM probe hands _cudnn_rnn unflattened weights (`_cudnn_rnn_sizes`): torch warns,
        # at the LSTM's own call, of a copy that a user's flattened module never makes
        quiet = warnings.catch_warnings() if tracker.cuda_workspaces else contextlib.nullcontext()
        policy = cuda_policy() if device == "cuda" and precision.autocast_dtype is not None \
            else contextlib.nullcontext()
        conversions = _fake_conversions() if fake else contextlib.nullcontext()
        unchecked = _distribution_checks_off() if fake else contextlib.nullcontext()
        with fake_mode or contextlib.nullcontext(), _dispatch_mode(tracker), quiet, policy, conversions, unchecked:
            if tracker.cuda_workspaces:
                warnings.filterwarnings("ignore", message="RNN module weights are not part of single contiguous chunk")
            torch.manual_seed(0)
            with tracker.off_device(device == "cuda"):
                model = _build(workload, fake_mode, skip_init)
            if device == "cuda":
                _moved_to_device(model, tracker)
            params = [p for p in model.parameters()]
            num_params = sum(p.numel() for p in params)
            blocks = repeated_blocks(model)
            block_bytes = max((sum(p.nbytes for p in b.parameters()) for b in blocks), default=0)
            for p in params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda q: tracker.relabel(q.grad, GRADS))
            ctx = prepare(model, workload.loss_fn, precision=precision, optimizer=optimizer, device_type="cpu",
                          optimizer_impl=optimizer_impl, checkpointing=checkpointing, fused_backward=fused_backward,
                          fake=fake)
            param_bytes = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
            tracker.param_keys = {p.untyped_storage()._cdata for p in model.parameters()}
            grad_bytes = 0
            for it in range(TRACED_STEPS):
                tracker.set_phase("batch")
                with tracker.off_device(device == "cuda"):
                    batch = build_batch(workload, batch_size, fake_mode)
                if device == "cuda":
                    batch = _moved_to_device(batch, tracker)
                for t in torch.utils._pytree.tree_flatten(batch)[0]:
                    tracker.track(t)
                tracker.count_flops = count_flops and it == 0

                def on_phase(name: str) -> None:
                    nonlocal grad_bytes
                    tracker.set_phase(name)
                    if name == "step":
                        grads = [p.grad for p in model.parameters() if p.grad is not None]
                        grad_bytes = max(grad_bytes, sum(tracker.bytes_of(g) for g in grads))
                    if name == "done":
                        tracker.count_flops = False
                        for opt in ctx.optimizers:
                            for state in opt.state.values():
                                for v in state.values():
                                    if isinstance(v, torch.Tensor):
                                        tracker.relabel(v, OPT_STATE)

                train_step(ctx, batch, phase=on_phase, before_backward=tracker.watch_backward)
                del batch
            opt_state_bytes = sum(tracker.bytes_of(v) for opt in ctx.optimizers for s in opt.state.values()
                                  for v in s.values() if isinstance(v, torch.Tensor))
            if fused_backward:
                grad_bytes = max((p.nbytes for p in model.parameters()), default=0)
    except (EstimateError, _BuildReadsValues):
        raise
    except Exception as exc:
        if "DataDependent" in type(exc).__name__:
            raise EstimateError(f"cannot trace {workload.name} on fake tensors: its code reads a tensor's value "
                                f"(data-dependent control flow, {type(exc).__name__})") from exc
        raise EstimateError(f"cannot trace {workload.name} on {'fake' if fake else 'real'} tensors: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
    if tracker.cuda_workspaces and (tracker.workspace_bytes or tracker.probed):
        torch.cuda.empty_cache()  # the probes' blocks go back to the device, not kept by this process
    curve, sizes, ids, untouched = _replay(tracker)
    phases = np.searchsorted(np.asarray(tracker.phase_marks, dtype=np.int64), np.arange(len(ids)), side="right")
    copies = len(tracker.copy_probes)
    # reductions whose kernels hold scratch: the others, most, were probed for nothing
    reductions = sum(sum(tracker.probed[k]) > 0 for k in tracker.reduction_probes)
    # products whose kernels hold scratch beside their output (the probe's second block; none on a CPU whose do not)
    products = sum(tracker.probed[k][1] > 0 for k in tracker.product_probes)
    return Trace(curve=curve, sizes=sizes, ids=ids, untouched=untouched, phases=phases.astype(np.int64),
                 param_bytes=int(param_bytes),
                 grad_bytes=int(grad_bytes), opt_state_bytes=int(opt_state_bytes), largest_block_bytes=int(block_bytes),
                 flops_per_step=tracker.flops, num_params=int(num_params), seconds=time.perf_counter() - t0,
                 sized_kernels=len(tracker.workspace_bytes) + len(tracker.probed) - copies - len(tracker.reduction_probes)
                 - len(tracker.product_probes),
                 probed_copies=copies, probed_reductions=reductions, probed_products=products,
                 sized_on="cuda" if tracker.cuda_workspaces else "cpu", cublas_threads=sum(kind == "cublas" for _, kind in tracker.cublas_at),
                 cublas_at=tuple(sorted((i, kind) for (_, kind), i in tracker.cublas_at.items())),
                 reduce_scratch=len(tracker.reduce_scratch), reduce_gpu=tracker.reduce_gpu,
                 reduce_specs=tuple(tracker.reduce_specs), unsized_cudnn=len(tracker.unsized_cudnn),
                 ctc_bounded=tracker.ctc_bounded)


def save_trace(trace: Trace, path: str) -> None:
    """Write a trace to an .npz file (the calibration process hands traces back this way)."""
    meta = {k: getattr(trace, k) for k in ("param_bytes", "grad_bytes", "opt_state_bytes", "largest_block_bytes",
                                           "flops_per_step", "num_params", "seconds")}
    extra = {name: getattr(trace, name) for name in ("untouched", "phases") if getattr(trace, name) is not None}
    np.savez(path, curve=trace.curve, sizes=trace.sizes, ids=trace.ids, meta=np.asarray(list(meta.values()), dtype=np.float64),
             **extra)


def load_trace(path: str) -> Trace:
    with np.load(path) as z:
        m = z["meta"].tolist()
        return Trace(curve=z["curve"], sizes=z["sizes"], ids=z["ids"], param_bytes=int(m[0]),
                     untouched=z["untouched"] if "untouched" in z.files else None,
                     phases=z["phases"] if "phases" in z.files else None,
                     grad_bytes=int(m[1]), opt_state_bytes=int(m[2]), largest_block_bytes=int(m[3]),
                     flops_per_step=int(m[4]), num_params=int(m[5]), seconds=float(m[6]))

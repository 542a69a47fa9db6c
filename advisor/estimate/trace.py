"""Trace two training steps on fake tensors: every storage allocation and free, in order, by what it is for
(the categories below), and the live bytes after each event."""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from advisor.config import Checkpointing, OptimizerKind, Precision
from advisor.errors import EstimateError
from advisor.estimate import scratch, scratch_cpu, scratch_cuda
from advisor.estimate.autocast_cuda import cuda_policy
from advisor.estimate.cuda_reduce import ReduceGpu, ReduceSpec
from advisor.estimate.dropout_cuda import cuda_dropout
from advisor.estimate.fake_build import (
    BuildReadsValues,
    build_batch,
    build_model,
    distribution_checks_off,
    fake_conversions,
    moved_to_device,
)
from advisor.estimate.fake_ops import accumulates_in_place, aliased_as_the_kernel, coo_bytes, ctc_fake, sparse_parts
from advisor.workload import Workload

# Category indices of the live-bytes curve.
# PARAM_COPIES: low-precision copies of parameters made in forward (autocast's weight cache);
# under ZeRO-3 they exist only for the gathered units, so they scale with the parameters.
PARAMS, GRADS, OPT_STATE, ACTIVATIONS, TEMPORARIES, STEP_TEMPS, INPUTS, PARAM_COPIES = range(8)
CATEGORY_NAMES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "step_temporaries",
                  "inputs", "param_copies")
GLOO_BUFFERED = ("all_gather", "reduce_scatter")  # collectives gloo runs through a buffer of the payload's size
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
    probed_reductions: int = 0  # reduction op shapes run for real whose kernels hold scratch (scratch_cpu.py)
    probed_products: int = 0  # 16-bit matrix product shapes run for real whose kernels hold scratch (scratch_cpu.py)
    # threads whose ops call cuBLAS (`scratch_cuda.cublas_ops`): the step's own (forward, optimizer) and autograd's
    # backward, which on CUDA runs on a device thread of its own; each gets a cuBLAS handle with a workspace
    # (cuda_alloc)
    cublas_threads: int = 2
    # where each thread first runs a cuBLAS op, and a cuBLASLt one: ((event index, "cublas" or "cublaslt"), ...);
    # its workspace is taken from the caching allocator right after that op's outputs (cuda_alloc.library_workspaces)
    cublas_at: tuple[tuple[int, str], ...] = ()
    # reduction op shapes whose cross-block scratch is worked out for a GPU not at hand (cuda_reduce.py)
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


def trace_training(workload: Workload, batch_size: int, **kwargs: Any) -> Trace:
    """Build `workload` and run two full training steps, recording memory (`_trace_training`'s arguments). A
    build that reads a tensor's value, which fake tensors do not have, is traced again from the start with
    torch.nn.init's initializers as no-ops (`Trace.init_skipped`): initial values change no memory, and the
    commonest such read is an initializer's (trunc_normal_'s rejection loop in torch 2.13, `if not
    mask.any()`, which torchvision's Swin and ConvNeXt and many ViTs call). Raises EstimateError where a build
    or a step still reads a value, or the model cannot be traced."""
    try:
        return _trace_training(workload, batch_size, **kwargs)
    except BuildReadsValues:
        return replace(_trace_training(workload, batch_size, skip_init=True, **kwargs), init_skipped=True)


def _trace_training(workload: Workload, batch_size: int, *, precision: Precision, optimizer: OptimizerKind,
                    checkpointing: Checkpointing | bool = Checkpointing.none, fused_backward: bool = False,
                    optimizer_impl: str | None = None,
                    fake: bool = True, count_flops: bool = True, cpu_workspaces: bool = False,
                    cuda_workspaces: bool = False, device: str = "cpu", reduce_gpu: ReduceGpu | None = None,
                    skip_init: bool = False) -> Trace:
    """One traced run: the build, then TRACED_STEPS training steps. fake=True (the estimator): on fake tensors.
    fake=False: on real CPU tensors, so real kernels choose their own paths (the calibration runs it in a fresh
    process). cpu_workspaces (this CPU is the target): oneDNN's workspaces and kernels' scratch sized by probes
    (scratch_cpu.py); cuda_workspaces (this machine's GPU is the target): CUDA kernels' scratch sized on the GPU
    (scratch_cuda.py). device "cuda": the run of docs/design.md ("what a measured peak means"), the model and
    each batch made on the CPU and moved, so only what is moved is on the device, and autocast follows CUDA's
    op rules (`autocast_cuda.cuda_policy`). reduce_gpu (a CUDA target not at hand): each reduction's
    cross-block scratch worked out for that GPU (cuda_reduce.py). skip_init: see `trace_training`."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from advisor.training import prepare, train_step

    t0 = time.perf_counter()
    tracker = _new_tracker(precision, fake, cpu_workspaces, cuda_workspaces, device, reduce_gpu)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    on_cuda = device == "cuda"
    try:
        with fake_mode or contextlib.nullcontext(), _dispatch_mode(tracker), _run_contexts(tracker, precision,
                                                                                           device, fake):
            torch.manual_seed(0)
            with tracker.off_device(on_cuda):
                model = build_model(workload, fake_mode, skip_init, precision)
            if on_cuda:
                moved_to_device(model, tracker)
            num_params, block_bytes = _watch_parameters(model, tracker)
            ctx = prepare(model, workload.loss_fn, precision=precision, optimizer=optimizer, device_type="cpu",
                          optimizer_impl=optimizer_impl, checkpointing=checkpointing, fused_backward=fused_backward,
                          fake=fake)
            param_bytes = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
            tracker.param_keys = {p.untyped_storage()._cdata for p in model.parameters()}
            phases = _PhaseWatch(tracker, model, ctx)
            for it in range(TRACED_STEPS):
                tracker.set_phase("batch")
                with tracker.off_device(on_cuda):
                    batch = build_batch(workload, batch_size, fake_mode)
                if on_cuda:
                    batch = moved_to_device(batch, tracker)
                for t in torch.utils._pytree.tree_flatten(batch)[0]:
                    tracker.track(t)
                tracker.count_flops = count_flops and it == 0
                train_step(ctx, batch, phase=phases, before_backward=tracker.watch_backward)
                del batch
            opt_state_bytes = sum(tracker.bytes_of(v) for opt in ctx.optimizers for s in opt.state.values()
                                  for v in s.values() if isinstance(v, torch.Tensor))
            grad_bytes = max((p.nbytes for p in model.parameters()), default=0) if fused_backward \
                else phases.grad_bytes
    except (EstimateError, BuildReadsValues):
        raise
    except Exception as exc:
        raise _trace_error(workload, fake, exc) from exc
    if tracker.cuda_workspaces and (tracker.workspace_bytes or tracker.probed):
        torch.cuda.empty_cache()  # the probes' blocks go back to the device, not kept by this process
    return _trace_of(tracker, param_bytes=int(param_bytes), grad_bytes=int(grad_bytes),
                     opt_state_bytes=int(opt_state_bytes), largest_block_bytes=int(block_bytes),
                     flops_per_step=tracker.flops, num_params=int(num_params), seconds=time.perf_counter() - t0)


def _new_tracker(precision: Precision, fake: bool, cpu_workspaces: bool, cuda_workspaces: bool, device: str,
                 reduce_gpu: ReduceGpu | None) -> Tracker:
    """A tracker for one run, told which target's kernels to size (see `_trace_training`)."""
    tracker = Tracker()
    tracker.cpu_workspaces = cpu_workspaces and fake
    if tracker.cpu_workspaces:  # a float32 workload may still run 16-bit products of its own
        tracker.scratch_products = scratch_cpu.scratch_products()
    tracker.cuda_workspaces = cuda_workspaces and fake
    tracker.cudnn_tf32 = precision == Precision.tf32  # advisor.training.set_matmul_precision's switch
    tracker.reduce_gpu = reduce_gpu if fake and device == "cuda" and not tracker.cuda_workspaces else None
    return tracker


@contextlib.contextmanager
def _run_contexts(tracker: Tracker, precision: Precision, device: str, fake: bool):
    """What the traced run holds besides the fake and dispatch modes: CUDA autocast's op rules and CUDA's
    dropout (dropout_cuda.py) for a CUDA target, and on fake tensors the conversions and unchecked
    distributions fake_build.py makes traceable."""
    # the cuDNN LSTM probe hands _cudnn_rnn unflattened weights (scratch_cuda.cudnn_rnn_sizes): torch warns,
    # at the LSTM's own call, of a copy that a user's flattened module never makes
    quiet = warnings.catch_warnings() if tracker.cuda_workspaces else contextlib.nullcontext()
    policy = cuda_policy() if device == "cuda" and precision.autocast_dtype is not None \
        else contextlib.nullcontext()
    dropout = cuda_dropout() if device == "cuda" else contextlib.nullcontext()
    conversions = fake_conversions() if fake else contextlib.nullcontext()
    unchecked = distribution_checks_off() if fake else contextlib.nullcontext()
    with quiet, policy, dropout, conversions, unchecked:
        if tracker.cuda_workspaces:
            warnings.filterwarnings("ignore", message="RNN module weights are not part of single contiguous chunk")
        yield


def _watch_parameters(model: Any, tracker: Tracker) -> tuple[int, int]:
    """Label each parameter's gradient as one once accumulated; returns (the model's parameter count, the
    parameter bytes of its largest repeated block)."""
    from advisor.training import repeated_blocks

    params = list(model.parameters())
    block_bytes = max((sum(p.nbytes for p in b.parameters()) for b in repeated_blocks(model)), default=0)
    for p in params:
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda q: tracker.relabel(q.grad, GRADS))
    return sum(p.numel() for p in params), block_bytes


class _PhaseWatch:
    """train_step's phase callback: marks each phase on the tracker, takes the gradients' bytes at the optimizer
    step (their most over the steps), and labels the optimizer's state when a step is done."""

    def __init__(self, tracker: Tracker, model: Any, ctx: Any) -> None:
        self.tracker, self.model, self.ctx = tracker, model, ctx
        self.grad_bytes = 0

    def __call__(self, name: str) -> None:
        import torch

        self.tracker.set_phase(name)
        if name == "step":
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            self.grad_bytes = max(self.grad_bytes, sum(self.tracker.bytes_of(g) for g in grads))
        if name == "done":
            self.tracker.count_flops = False
            for opt in self.ctx.optimizers:
                for state in opt.state.values():
                    for v in state.values():
                        if isinstance(v, torch.Tensor):
                            self.tracker.relabel(v, OPT_STATE)


def _trace_error(workload: Workload, fake: bool, exc: Exception) -> EstimateError:
    """The EstimateError for a run that failed with `exc`."""
    if "DataDependent" in type(exc).__name__:
        return EstimateError(f"cannot trace {workload.name} on fake tensors: its code reads a tensor's value "
                             f"(data-dependent control flow, {type(exc).__name__})")
    first_line = str(exc).splitlines()[0] if str(exc) else ""
    return EstimateError(f"cannot trace {workload.name} on {'fake' if fake else 'real'} tensors: "
                         f"{type(exc).__name__}: {first_line}")


def _trace_of(tracker: Tracker, **sizes: Any) -> Trace:
    """The Trace of the tracker's events, with the run's `sizes` (Trace's byte and count fields)."""
    curve, signed, ids, untouched = _replay(tracker)
    phases = np.searchsorted(np.asarray(tracker.phase_marks, dtype=np.int64), np.arange(len(ids)), side="right")
    copies = len(tracker.copy_probes)
    # reductions whose kernels hold scratch: the others, most, were probed for nothing
    reductions = sum(sum(tracker.probed[k]) > 0 for k in tracker.reduction_probes)
    # products whose kernels hold scratch beside their output (the probe's second block; none on a CPU whose do not)
    products = sum(tracker.probed[k][1] > 0 for k in tracker.product_probes)
    sized = len(tracker.workspace_bytes) + len(tracker.probed) - copies - len(tracker.reduction_probes) \
        - len(tracker.product_probes)
    return Trace(curve=curve, sizes=signed, ids=ids, untouched=untouched, phases=phases.astype(np.int64), **sizes,
                 sized_kernels=sized, probed_copies=copies, probed_reductions=reductions, probed_products=products,
                 sized_on="cuda" if tracker.cuda_workspaces else "cpu",
                 cublas_threads=sum(kind == "cublas" for _, kind in tracker.cublas_at),
                 cublas_at=tuple(sorted((i, kind) for (_, kind), i in tracker.cublas_at.items())),
                 reduce_scratch=len(tracker.reduce_scratch), reduce_gpu=tracker.reduce_gpu,
                 reduce_specs=tuple(tracker.reduce_specs), unsized_cudnn=len(tracker.unsized_cudnn),
                 ctc_bounded=tracker.ctc_bounded)


def _dispatch_mode(tracker: Tracker):
    """A dispatch mode above the fake mode that runs each aten op and records on `tracker` what it allocates:
    its outputs, and what its kernel holds beyond them by the first scratch rule that applies (scratch.py); also
    each thread's first cuBLAS op and, while counted, the op's FLOPs."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.flop_counter import flop_registry

    cublas_ops = scratch_cuda.cublas_ops()
    rules = scratch.active_rules(tracker)
    # what allocates nothing and is most of a trace's calls: a fake tensor's device is answered in Python,
    # and the autograd engine asks it of every gradient; .item() on the optimizer's step counters
    queries = {torch.ops.prim.device.default, torch.ops.aten.size.default, torch.ops.aten.stride.default,
               torch.ops.aten.storage_offset.default, torch.ops.aten._local_scalar_dense.default}
    # a fake collective's wait makes a new tensor where a real one returns the collective's own output
    wait_tensor = torch.ops._c10d_functional.wait_tensor.default
    ctc_ops = {torch.ops.aten._ctc_loss.default, torch.ops.aten._ctc_loss.Tensor,
               torch.ops.aten._ctc_loss_backward.default, torch.ops.aten._ctc_loss_backward.Tensor}

    class TrackingMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in queries:
                return func(*args, **(kwargs or {}))
            kwargs = kwargs or {}
            collective = tracker.comm.record(func, args, kwargs) if tracker.comm is not None else None
            ctc = func in ctc_ops and isinstance(args[0], FakeTensor)  # fake ops refuse it: its shape needs values
            # a DTensor op's kernels run inside DTensor's dispatch, on the local shards, out of this mode's sight: its
            # outputs are recorded by their local shards, and no scratch rule sizes its kernels from global shapes
            sharded = tracker.comm is not None and _any_dtensor(args)
            out = ctc_fake(tracker, func, args) if ctc else func(*args, **kwargs)
            if type(out) is tuple:
                out = aliased_as_the_kernel(func, out)
            rule = None if ctc or sharded else scratch.rule_for(rules, tracker, func, args, kwargs)
            if rule is not None:
                out = rule.apply(tracker, func, args, kwargs, out)
            if func is torch.ops.aten.add.Tensor and tracker.accumulating and not sharded \
                    and accumulates_in_place(args):
                tracker.reuse(out, args[0])
                return out
            if func is wait_tensor and isinstance(out, torch.Tensor):  # a real wait returns its input: same memory
                tracker.reuse(out, args[0])
                return out
            category = None
            if (func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor)
                    and args[0].layout == torch.strided
                    and local_tensor(args[0]).untyped_storage()._cdata in tracker.param_keys):
                category = PARAM_COPIES  # a parameter's low-precision copy
            if isinstance(out, FakeTensor) and out.layout == torch.sparse_coo:
                tracker.track_sparse(out, [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)],
                                     category)
            elif isinstance(out, torch.Tensor):  # the common case, without pytree's cost
                tracker.track(out, category)
            else:
                for t in tree_flatten(out)[0]:
                    tracker.track(t, category)
            if collective is not None and collective[0] in GLOO_BUFFERED and tracker.gloo:
                # gloo stages an all-gather's output and a reduce-scatter's input in a buffer of its own, the
                # payload's size, while it runs (bench/research/gloo_buffers.py,
                # bench/results/archive/gloo-buffers.json)
                tracker.scratch(collective[1])
            if func.overloadpacket in cublas_ops:
                thread = "backward" if tracker.phase == "backward" else "main"
                kinds = ("cublas", "cublaslt") if scratch_cuda.runs_on_cublaslt(func, args, kwargs) else ("cublas",)
                for kind in kinds:
                    tracker.cublas_at.setdefault((thread, kind), len(tracker.events))
            if tracker.count_flops and not sharded and func.overloadpacket in flop_registry:
                tracker.flops += int(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))
            return out

    return TrackingMode()


class Tracker:
    """Records each new storage an op makes as an allocation, labelled by the phase it falls in, and its free,
    which a weakref finalizer on the storage tells."""

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
        self.cuda_workspaces = False  # size CUDA kernels' scratch (scratch_cuda.py) by running them on the GPU
        self.cudnn_tf32 = False  # whether the run lets cuDNN use TF32 (precision tf32): it picks other algorithms
        self.reduce_gpu: ReduceGpu | None = None  # a CUDA target not at hand: reductions' scratch from torch's rules
        self.reduce_scratch: set[ReduceSpec] = set()  # reductions that took some (`scratch_cuda.reduction_scratch`)
        self.reduce_specs: list[tuple[int, int, ReduceSpec]] = []  # see Trace.reduce_specs
        self.ctc_bounded = 0  # ctc_loss calls whose target lengths were tensors: sized at their bound (fake_ops.py)
        self.unsized_cudnn: set[str] = set()  # with reduce_gpu: cuDNN op shapes whose workspace nothing sizes
        self.workspace_bytes: dict[str, int] = {}  # an LSTM layer's shapes, dtypes and scalars -> its workspace's bytes
        self.probed: dict[str, tuple[int, ...]] = {}  # a probed op's shapes, ... -> its scratch's blocks (kernel_probe)
        self.copy_probes: set[str] = set()  # keys of `probed` probed for a contiguous copy of a strided input
        self.reduction_probes: set[str] = set()  # keys of `probed` probed for a reduction's scratch
        self.product_probes: set[str] = set()  # keys of `probed` probed for a 16-bit matrix product's scratch
        self.scratch_products: frozenset = frozenset()  # 16-bit dtypes whose products hold scratch here (probed)
        self.workspace_untouched: dict[str, int] = {}  # ... -> bytes of the workspace its kernel never writes
        self.rnn_sizes: dict[str, tuple[int, int, int]] = {}  # ... -> cuDNN's LSTM (`scratch_cuda.cudnn_rnn_sizes`)
        self.untouched: dict[int, int] = {}  # allocation id -> bytes never written (see Trace.untouched)
        # (thread: "main" or "backward", "cublas"/"cublaslt") -> event index of that thread's first such op
        self.cublas_at: dict[tuple[str, str], int] = {}
        self.finalizers: dict[int, weakref.finalize] = {}  # storage pointer -> its death notice
        self.sparse_entries: dict[Any, int] = WeakIdKeyDictionary()  # see `track_sparse`
        # True between an autograd node's apply and the next node's: the engine is adding the node's
        # outputs into the input buffers of the nodes they feed (see `accumulates_in_place`)
        self.accumulating = False
        self.paused = False  # `off_device`
        self.comm: Any = None  # advisor.parallel.comm.CommCounter: a rank's collectives, in a parallel trace
        self.gloo = False  # the collectives run on gloo (a CPU target): GLOO_BUFFERED ones hold a buffer of their own

    @contextlib.contextmanager
    def off_device(self, on: bool):
        """While `on`, record nothing: a CUDA target's build and batches are made on the CPU and only what is
        moved reaches the device (`fake_build.moved_to_device`)."""
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
        A sparse tensor's allocations are its index and value tensors' (`fake_ops.sparse_parts`)."""
        import torch

        if not isinstance(t, torch.Tensor) or self.paused:
            return
        t = local_tensor(t)
        if t.device.type == "meta":  # a model built on the meta device holds no memory until it is materialised
            return
        if t.layout != torch.strided:
            for part in sparse_parts(t):
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
        as many as its largest sparse input: exact for a transpose, a bound for a coalesce. What a sparse op's
        CPU kernel holds inside itself, a probe measures (`scratch_cpu.is_sparse_op`)."""
        import torch

        entries = max((self.entries_of(a) for a in inputs if a.layout == torch.sparse_coo), default=0)
        if out.layout != torch.sparse_coo or out._nnz() or not entries:
            self.track(out, category)
            return
        self.sparse_entries[out] = entries  # for the ops that take it in turn
        index_bytes, value_bytes = coo_bytes(out, entries)
        self.track(out._indices(), category, nbytes=index_bytes)
        self.track(out._values(), category, nbytes=value_bytes)

    def entries_of(self, t: Any) -> int:
        """A sparse COO tensor's entries as the trace holds them (`track_sparse`)."""
        return self.sparse_entries.get(t, t._nnz())

    def bytes_of(self, t: Any) -> int:
        """A tensor's bytes; a sparse one's, its index and value tensors' (a sparse gradient's, from
        nn.Embedding(sparse=True), and SGD's momentum buffer of it), as many entries as `track_sparse` sized."""
        import torch

        t = local_tensor(t)
        if t.layout == torch.strided:
            return int(t.nbytes)
        entries = self.sparse_entries.get(t)
        if entries is None or t.layout != torch.sparse_coo:
            return sum(int(p.nbytes) for p in sparse_parts(t))
        return sum(coo_bytes(t, entries))

    def scratch(self, *nbytes: int) -> list[int]:
        """Blocks an op holds only while it runs (a probed op's scratch, a reduction's): allocated in order,
        then freed, the last first; their allocation ids, none while paused. Recorded as events without making
        tensors (a fake allocation costs a dispatch through FakeTensorMode), and for every candidate op even
        where 0 bytes (the probe found none, or its inputs were past its PROBE_INPUT_LIMIT): the batch model
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

    def resized(self, storage: Any, nbytes: int, category: int) -> None:
        """`storage` was resized in place to `nbytes`: what it held is freed, and a new allocation of `category`
        made where `nbytes` > 0 (FSDP2's unsharded parameters: `rank_trace._resizes_tracked`)."""
        if self.paused:
            return
        key = storage._cdata
        aid = self.live_ids.pop(key, None)
        if aid is not None:
            self.finalizers.pop(key).detach()
            self.events.append(-(aid + 1))
        if nbytes > 0:
            aid = len(self.nbytes)
            self.live_ids[key] = aid
            self.nbytes.append(nbytes)
            self.labels.append(category)
            self.events.append(aid + 1)
            self.finalizers[key] = weakref.finalize(storage, self._free, key, aid)

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

        t = local_tensor(t)
        if t.layout != torch.strided:  # a sparse gradient (nn.Embedding(sparse=True))
            for part in sparse_parts(t):
                self.relabel(part, category)
            return
        aid = self.live_ids.get(t.untyped_storage()._cdata)
        if aid is not None:
            self.labels[aid] = category


def local_tensor(t: Any) -> Any:
    """What a rank holds of `t`: a DTensor's local shard, any other tensor itself."""
    return getattr(t, "_local_tensor", t) if type(t).__name__ == "DTensor" else t


def _any_dtensor(args: tuple) -> bool:
    return any(type(a).__name__ == "DTensor" for a in args) or any(
        type(x).__name__ == "DTensor" for a in args if isinstance(a, (list, tuple)) for x in a)


def _replay(tracker: Tracker) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
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


def save_trace(trace: Trace, path: str) -> None:
    """Write a trace to an .npz file (the calibration process hands traces back this way)."""
    meta = {k: getattr(trace, k) for k in ("param_bytes", "grad_bytes", "opt_state_bytes", "largest_block_bytes",
                                           "flops_per_step", "num_params", "seconds")}
    extra = {name: getattr(trace, name) for name in ("untouched", "phases") if getattr(trace, name) is not None}
    np.savez(path, curve=trace.curve, sizes=trace.sizes, ids=trace.ids,
             meta=np.asarray(list(meta.values()), dtype=np.float64), **extra)


def load_trace(path: str) -> Trace:
    with np.load(path) as z:
        m = z["meta"].tolist()
        return Trace(curve=z["curve"], sizes=z["sizes"], ids=z["ids"], param_bytes=int(m[0]),
                     untouched=z["untouched"] if "untouched" in z.files else None,
                     phases=z["phases"] if "phases" in z.files else None,
                     grad_bytes=int(m[1]), opt_state_bytes=int(m[2]), largest_block_bytes=int(m[3]),
                     flops_per_step=int(m[4]), num_params=int(m[5]), seconds=float(m[6]))

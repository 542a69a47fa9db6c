"""Trace one rank of a parallel run: its program (advisor/parallel/program.py) on fake tensors, under a fake
process group of the layout's size, as torchtitan estimates FSDP memory. Every allocation the rank's code makes
is recorded as in a single-device trace (trace.py), its DTensors by their local shards, and every collective by
its payload (advisor/parallel/comm.py)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from advisor.config import Checkpointing, OptimizerKind, Precision
from advisor.errors import EstimateError
from advisor.estimate.fake_build import build_batch, build_model
from advisor.estimate.trace import (
    PARAMS,
    TRACED_STEPS,
    Trace,
    Tracker,
    _dispatch_mode,
    _new_tracker,
    _PhaseWatch,
    _run_contexts,
    _trace_of,
    _watch_parameters,
    local_tensor,
)
from advisor.parallel.layout import Layout
from advisor.workload import Workload


@dataclass
class RankTrace:
    """One rank's trace, where it sits in the mesh, and its collectives' payload bytes per step by kind.
    `peer_trace`: on gloo, where this rank's build scatters tensors to its tensor-parallel peers (a workload built
    whole, then sharded: the root is tp 0), the peers' trace: the same less the root's own staging (GlooStaging);
    else None."""

    rank: int
    coords: dict[str, int]
    trace: Trace
    comm_bytes: dict[str, int]
    peer_trace: Trace | None = None


def trace_rank(workload: Workload, layout: Layout, rank: int, batch_size: int, *, precision: Precision,
               optimizer: OptimizerKind, optimizer_impl: str | None = None,
               checkpointing: Checkpointing = Checkpointing.none,
               cpu_workspaces: bool = False, fake: bool = True, gloo: bool = True,
               grad_accum: int = 1) -> RankTrace:
    """Build rank `rank`'s program and run TRACED_STEPS steps of a batch of `batch_size` samples per data-parallel
    replica, recording what it allocates; each step accumulates the gradients of `grad_accum` such batches
    (advisor.parallel.accumulate.accumulated_steps). fake=True (the estimator): on fake tensors, in a fake process
    group of `layout.world` ranks made and destroyed here (the caller's process must be in none). fake=False (a check of
    the estimator): on real tensors, in the real process group this process already joined. `gloo`: the ranks'
    collectives are gloo's (a CPU target), which stage some payloads in buffers of their own. Raises EstimateError
    where the program cannot run on fake tensors."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from advisor.parallel.comm import CommCounter, GlooStaging
    from advisor.parallel.program import make_mesh
    from advisor.parallel.tensor import loss_ops_under

    if fake and dist.is_initialized():
        raise EstimateError("a rank's trace makes its own fake process group; this process is already in one")
    t0 = time.perf_counter()
    tracker = _new_tracker(precision, fake, cpu_workspaces, False, "cpu", None)
    tracker.comm = GlooStaging(tracker.scratch) if gloo else CommCounter()
    tracker.gloo = gloo
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    if fake:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world)
    try:
        mesh = make_mesh(layout, "cpu")
        mode = _dispatch_mode(tracker)
        with fake_mode or contextlib.nullcontext(), mode, loss_ops_under(mode), \
                _run_contexts(tracker, precision, "cpu", fake), _resizes_tracked(tracker), _meshes_outside_modes(), \
                static_pipeline(gloo) if fake else contextlib.nullcontext():
            program, sizes, comm = _run(workload, layout, rank, batch_size, tracker, fake_mode, mesh,
                                        grad_accum=grad_accum, precision=precision, optimizer=optimizer,
                                        optimizer_impl=optimizer_impl, checkpointing=checkpointing)
    except EstimateError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise EstimateError(f"cannot trace rank {rank} of {workload.name} ({layout.label()}) on "
                            f"{'fake' if fake else 'real'} tensors: {type(exc).__name__}: {first[:300]}") from exc
    finally:
        if fake:
            dist.destroy_process_group()
            _forget_meshes()
    trace = _trace_of(tracker, **sizes, flops_per_step=0, seconds=time.perf_counter() - t0)
    peer_trace = None
    if getattr(tracker.comm, "staged", None):
        for aid in tracker.comm.staged:  # the scatters' receivers make no flat copy
            tracker.nbytes[aid] = 0
        peer_trace = _trace_of(tracker, **sizes, flops_per_step=0, seconds=time.perf_counter() - t0)
    return RankTrace(rank=rank, coords=program.coords, trace=trace, comm_bytes=comm, peer_trace=peer_trace)


def _run(workload: Workload, layout: Layout, rank: int, batch_size: int, tracker: Tracker, fake_mode: Any,
         mesh: Any, grad_accum: int = 1, **knobs: Any) -> tuple[Any, dict[str, int], dict[str, int]]:
    """Build the rank's program and step it TRACED_STEPS times under the tracker; (the program, Trace's sizes, the
    collective bytes of the last step by kind)."""
    import torch

    from advisor.parallel.accumulate import accumulated_steps
    from advisor.parallel.program import build_program

    torch.manual_seed(0)
    build = (lambda: build_model(workload, fake_mode, False)) if fake_mode is not None else None
    program = build_program(workload, layout, rank=rank, device_type="cpu", device=torch.device("cpu"),
                            batch_size=batch_size, build=build, mesh=mesh, **knobs)
    num_params, block_bytes = _watch_parameters(program.model, tracker)
    params = list(program.model.parameters())
    param_bytes = sum(tracker.bytes_of(p) for p in params)
    tracker.param_keys = {local_tensor(p).untyped_storage()._cdata for p in params}
    phases = _PhaseWatch(tracker, program.model, program)
    comm: dict[str, int] = {}
    for it in range(TRACED_STEPS):
        for kwargs, times in accumulated_steps(grad_accum):
            tracker.set_phase("batch")
            batch = build_batch(workload, batch_size, fake_mode) if fake_mode is not None \
                else workload.make_batch(batch_size)
            for t in torch.utils._pytree.tree_flatten(batch)[0]:
                tracker.track(t)
            tracker.comm.reset()
            program.step(batch, phases, **kwargs)
            del batch
            if it == TRACED_STEPS - 1:  # the last step's collectives, each micro-step's for the batches it stands for
                for kind, nbytes in tracker.comm.bytes.items():
                    comm[kind] = comm.get(kind, 0) + times * nbytes
    opt_state = sum(tracker.bytes_of(v) for opt in program.optimizers for s in opt.state.values()
                    for v in s.values() if isinstance(v, torch.Tensor))
    return program, {"param_bytes": int(param_bytes), "grad_bytes": int(phases.grad_bytes),
                     "opt_state_bytes": int(opt_state), "largest_block_bytes": int(block_bytes),
                     "num_params": int(num_params)}, {k: v for k, v in sorted(comm.items()) if v}


@contextlib.contextmanager
def _resizes_tracked(tracker: Tracker):
    """FSDP2 frees an unsharded parameter by resizing its storage to 0 and makes it again by resizing it back, so
    the storage object lives on: each resize is recorded as the free or the allocation it is."""
    import torch

    original = torch.UntypedStorage.resize_

    def resize_(storage: Any, size: int) -> Any:
        before = storage.nbytes()
        out = original(storage, size)
        if int(size) != before:
            tracker.resized(storage, int(size), PARAMS)
        return out

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original


@contextlib.contextmanager
def _meshes_outside_modes():
    """A device mesh made during the trace (FSDP2 joins the dp and tp meshes into one) reads its own rank table,
    which a fake tensor cannot give: its bookkeeping runs on real tensors, outside the fake and tracking modes.
    It allocates none of the model's memory."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils._python_dispatch import _disable_current_modes

    original = DeviceMesh.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        with _disable_current_modes():
            original(self, *args, **kwargs)

    DeviceMesh.__init__ = init
    try:
        yield
    finally:
        DeviceMesh.__init__ = original


@contextlib.contextmanager
def static_pipeline(gloo: bool = False):
    """Every stage gives its input and output shapes (advisor/parallel/pipeline.py), so a pipeline schedule's
    warm-up vote, which asks the other ranks whether they did too and reads the answer's value, is settled here
    as they would settle it: static shapes, no vote. A fake process group carries no answer to read. `gloo`: the
    sends are gloo's, which hold their tensors for the work's life, not until its wait (`_HeldWork`)."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._utils import InferenceMode

    original = schedules._PipelineSchedule._warmup_p2p

    def warmup(self: Any, stages: list, has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedules._PipelineSchedule._warmup_p2p = warmup
    batch_p2p = schedules._batch_p2p
    schedules._batch_p2p = lambda ops, desc=None: _held_until_waited(batch_p2p(ops, desc), ops, gloo)
    try:
        yield
    finally:
        schedules._PipelineSchedule._warmup_p2p = original
        schedules._batch_p2p = batch_p2p


class _HeldWork:
    """A real process group's send keeps its tensor until the send is waited on (NCCL), or for as long as the
    work itself lives (gloo: ProcessGroupGloo::SendWork holds it as a member, and a schedule keeps its waited
    sends' works until its next send); a fake one's lets it go at once. The schedule's sends are held so, the
    tensors with the first of their batch's works."""

    def __init__(self, work: Any, tensors: list, gloo: bool = False) -> None:
        self.work, self.tensors, self.gloo = work, tensors, gloo

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        if not self.gloo:
            self.tensors = []
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def _held_until_waited(works: list, ops: list, gloo: bool = False) -> list:
    import torch.distributed as dist

    sends = [op.tensor for op in ops if op.op is dist.isend]
    return [_HeldWork(works[0], sends, gloo), *works[1:]] if works and sends else works


def _forget_meshes() -> None:
    """DTensor caches sharding decisions keyed by meshes that compare equal across process groups; a later trace in
    this process makes a new group, so what was cached for the destroyed one (its group names) is dropped."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()


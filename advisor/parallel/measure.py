"""Each rank's real memory and collective bytes in a parallel run on this machine: `world` fresh processes over
gloo (CPU) or NCCL (one GPU each), every rank running its program (advisor/parallel/program.py) for a few steps.

`alloc` on the CPU: the exact peak of live tensor bytes from the profiler's memory events (advisor/measure.py's
protocol), from just before the build; on CUDA max_memory_allocated and max_memory_reserved. Collective bytes are
those of one more step, after the measured ones. Run as `python -m advisor.parallel.measure '<json request>'` (one
rank; torchrun's variables set) or through `measure_ranks`.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from advisor.config import Checkpointing, OptimizerKind, Precision
from advisor.errors import TrialError
from advisor.parallel.layout import Layout


class RankMeasureRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    workload: str
    workload_args: dict[str, Any] = Field(default_factory=dict)
    layout: Layout
    batch_size: int = Field(gt=0, description="Samples per data-parallel replica per step.")
    precision: Precision = Precision.fp32
    optimizer: OptimizerKind = OptimizerKind.adamw
    optimizer_impl: Literal["for-loop", "foreach", "fused"] | None = None
    checkpointing: Checkpointing = Checkpointing.none
    steps: int = Field(default=3, ge=2)
    device: Literal["cpu", "cuda"] = "cpu"
    threads: int | None = Field(default=1, gt=0, description="Intra-op threads per rank (None: torch's default).")
    mode: Literal["alloc", "sync", "trace"] = Field(
        default="alloc", description="'alloc': the profiler's live tensor bytes; 'sync': the same, each rank alone in "
        "a fake process group, whose collectives return at once (no data moves; the program's own tensor lifetimes, "
        "with no collective held by a slower thread); 'trace': the estimator's tracer on these real ranks' tensors "
        "(advisor.estimate.rank_trace with fake=False).")


class RankMeasure(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int
    coords: dict[str, int] = Field(description="The rank's index along pp, dp and tp.")
    alloc_peak_bytes: int = Field(description="Peak of live tensor bytes over the build and the steps.")
    cuda_reserved_bytes: int | None = None
    comm_bytes: dict[str, int] = Field(description="Payload bytes of the last step by collective kind "
                                       "(advisor/parallel/comm.py).")
    seconds: float


def measure_ranks(req: RankMeasureRequest, timeout_s: float = 600.0) -> list[RankMeasure]:
    """Run `req` on `req.layout.world` fresh local processes; their measurements in rank order."""
    from advisor.measure import PROFILED_MMAP_THRESHOLD
    from advisor.procmem import malloc_env

    world = req.layout.world
    env = dict(malloc_env(PROFILED_MMAP_THRESHOLD), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    with tempfile.TemporaryDirectory(prefix="advisor-ranks-") as out:
        procs = []
        for rank in range(world):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), ADVISOR_RANK_OUT=os.path.join(out, f"{rank}"))
            procs.append(subprocess.Popen([sys.executable, "-m", "advisor.parallel.measure", req.model_dump_json()],
                                          env=rank_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                          start_new_session=True))
        errors = _wait_all(procs, timeout_s)
        if errors:
            raise TrialError(f"parallel measurement of {req.workload} ({req.layout.label()}) failed: {errors[0]}")
        return [RankMeasure.model_validate_json(open(os.path.join(out, f"{r}")).read()) for r in range(world)]


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now (the ranks' rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> list[str]:
    """Wait for every rank; kill them all past `timeout_s`. One line per rank that failed."""
    import signal

    deadline = time.monotonic() + timeout_s
    errors = []
    for rank, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            return [f"timed out after {timeout_s:.0f} s"]
        if proc.returncode != 0:
            lines = [ln for ln in err.strip().splitlines() if ln.strip()]
            errors.append(f"rank {rank} exit {proc.returncode}: {lines[-1] if lines else '(no output)'}")
    return errors


def run_rank(req: RankMeasureRequest) -> RankMeasure:
    """This process's rank of `req`: join the group, build, step, measure."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from advisor.measure import replay_memory_events
    from advisor.parallel.comm import CommCounter
    from advisor.parallel.program import build_program
    from advisor.workload import load_workload

    rank = int(os.environ["RANK"])
    t0 = time.perf_counter()
    if req.threads:
        torch.set_num_threads(req.threads)
    cuda = req.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    sync = req.mode == "sync"
    if sync:  # this rank alone: every collective of a fake group returns at once, moving nothing
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=req.layout.world)
    else:
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=req.layout.world,
                                timeout=timedelta(seconds=120))
    workload = load_workload(req.workload, req.workload_args)
    torch.manual_seed(0)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if req.mode == "trace":
        return _traced(req, workload, rank, t0)
    counter = CommCounter()
    batch = workload.make_batch(req.batch_size)
    if cuda:
        batch = torch.utils._pytree.tree_map(lambda t: t.to(device), batch)
        torch.cuda.reset_peak_memory_stats()
    profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True) if not cuda else None
    from advisor.estimate.rank_trace import static_pipeline

    with profiler or contextlib.nullcontext(), static_pipeline(gloo=not cuda) if sync else contextlib.nullcontext():
        program = build_program(workload, req.layout, rank=rank, device_type=req.device, device=device,
                                precision=req.precision, optimizer=req.optimizer, optimizer_impl=req.optimizer_impl,
                                checkpointing=req.checkpointing, batch_size=req.batch_size)
        for _ in range(req.steps):
            program.step(batch)
    peak = replay_memory_events(profiler)[0] if profiler is not None else torch.cuda.max_memory_allocated()
    reserved = torch.cuda.max_memory_reserved() if cuda else None
    # collectives counted in a step of their own, after the measured ones: a dispatch mode changes how DTensor
    # dispatches (its Python path, not its C++ one), and so when some of its tensors are freed
    with counter.counting():
        program.step(batch)
    dist.barrier()
    dist.destroy_process_group()
    return RankMeasure(rank=rank, coords=program.coords, alloc_peak_bytes=int(peak), cuda_reserved_bytes=reserved,
                       comm_bytes=counter.per_step(1), seconds=time.perf_counter() - t0)


def _traced(req: RankMeasureRequest, workload: Any, rank: int, t0: float) -> RankMeasure:
    import torch.distributed as dist

    from advisor.estimate.rank_trace import trace_rank

    rt = trace_rank(workload, req.layout, rank, req.batch_size, precision=req.precision, optimizer=req.optimizer,
                    optimizer_impl=req.optimizer_impl, checkpointing=req.checkpointing, fake=False)
    dist.barrier()
    dist.destroy_process_group()
    return RankMeasure(rank=rank, coords=rt.coords, alloc_peak_bytes=rt.trace.peak_bytes, comm_bytes=rt.comm_bytes,
                       seconds=time.perf_counter() - t0)


def _main() -> int:
    req = RankMeasureRequest.model_validate_json(sys.argv[1])
    result = run_rank(req)
    with open(os.environ["ADVISOR_RANK_OUT"], "w") as f:
        f.write(result.model_dump_json())
    sys.stdout.flush()
    time.sleep(0.2)  # trial.GLOO_EXIT_PAUSE_S: gloo's workers finish freeing before the interpreter goes
    os._exit(0)


if __name__ == "__main__":
    sys.exit(_main())

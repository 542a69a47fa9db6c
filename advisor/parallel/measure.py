"""Each rank's real memory and collective bytes in a parallel run on this machine: `world` processes forked from
the warm fork server, over gloo (CPU) or NCCL (one GPU each), every rank running its program
(advisor/parallel/program.py) for a few steps.

`alloc` on the CPU: the exact peak of live tensor bytes from the profiler's memory events (advisor/measure.py's
protocol), from just before the build; on CUDA max_memory_allocated and max_memory_reserved. Collective bytes are
those of one more step, after the measured ones. Run as `python -m advisor.parallel.measure '<json request>'` (one
rank; torchrun's variables set) or through `measure_ranks`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from typing import Any, Callable, Literal

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
    """Run `req` on `req.layout.world` local processes, each forked from this process's warm fork server (torch
    imported once: advisor/isolation/forkserver.py) and running `entry`; their measurements in rank order."""
    from advisor.isolation.forkserver import reap
    from advisor.isolation.pool import fork_server

    world = req.layout.world
    env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    with tempfile.TemporaryDirectory(prefix="advisor-ranks-") as out:
        server = fork_server()
        procs, logs = [], [os.path.join(out, f"{rank}.log") for rank in range(world)]
        try:
            for rank in range(world):
                procs.append(server.spawn("advisor.parallel.measure:entry",
                                          [req.model_dump_json(), os.path.join(out, f"{rank}"), logs[rank]],
                                          dict(env, RANK=str(rank), LOCAL_RANK=str(rank))))
            errors = wait_forked(procs, logs, timeout_s)
        finally:
            reap(procs)
        if errors:
            raise TrialError(f"parallel measurement of {req.workload} ({req.layout.label()}) failed: {errors[0]}")
        return [RankMeasure.model_validate_json(open(os.path.join(out, f"{r}")).read()) for r in range(world)]


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now (the ranks' rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_forked(procs: list[Any], logs: list[str], timeout_s: float) -> list[str]:
    """Wait for every rank forked from the fork server (ForkedProcess, each writing its output to its `logs`
    file), for at most `timeout_s`, or until a rank has failed and the others had RANK_FAILURE_GRACE_S to follow
    (then `reap` them: advisor/isolation/forkserver.py). One line per rank that failed: its log's last."""
    from advisor.trial import RANK_FAILURE_GRACE_S

    deadline = time.monotonic() + timeout_s
    failed_at = None
    while True:
        codes = [p.exitcode for p in procs]
        if all(c is not None for c in codes):
            break
        now = time.monotonic()
        if any(c not in (None, 0) for c in codes):
            failed_at = failed_at or now
        if any(p.server.dead for p in procs):  # no exit will be told any more
            return ["the fork server exited"]
        if now > deadline:
            return [f"timed out after {timeout_s:.0f} s"]
        if failed_at is not None and now - failed_at > RANK_FAILURE_GRACE_S:  # the others wait in a collective
            break
        time.sleep(0.05)
    errors = []
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        if proc.exitcode != 0:
            lines = [ln for ln in open(log, errors="replace").read().splitlines() if ln.strip()] \
                if os.path.exists(log) else []
            errors.append(f"rank {rank} exit {proc.exitcode}: {lines[-1] if lines else '(no output)'}")
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


def forked_rank(log_path: str, body: Callable[[], None]) -> None:
    """Run `body` as a rank forked from the fork server: its own session and process group, its output to
    `log_path`, then the pause gloo's workers need (GLOO_EXIT_PAUSE_S). Exits 0, or 1 with the traceback in the
    log."""
    import traceback

    from advisor.isolation.forkserver import own_group
    from advisor.trial import GLOO_EXIT_PAUSE_S

    own_group(log_path, os.O_TRUNC)
    code = 1
    try:
        body()
        code = 0
    except BaseException:  # noqa: BLE001 - told to the caller through the log and the exit code
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(GLOO_EXIT_PAUSE_S)  # gloo's workers finish freeing before the interpreter goes
    os._exit(code)


def entry(request_json: str, out_path: str, log_path: str) -> None:
    """A rank of `measure_ranks` (`forked_rank`): glibc's thresholds of advisor/measure.py's `alloc` mode
    (PROFILED_MMAP_THRESHOLD: the server read none), then `run_rank`, its measurement written to `out_path`."""

    def body() -> None:
        from advisor.measure import PROFILED_MMAP_THRESHOLD
        from advisor.procmem import set_malloc_thresholds

        set_malloc_thresholds(PROFILED_MMAP_THRESHOLD)
        result = run_rank(RankMeasureRequest.model_validate_json(request_json))
        with open(out_path, "w") as f:
            f.write(result.model_dump_json())

    forked_rank(log_path, body)


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

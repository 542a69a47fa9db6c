"""One trial inside its own process (one per rank): `python -m probes.child REQUEST.json`.

The parent (probes/runner.py) starts it with torchrun's variables (RANK, WORLD_SIZE, ...) and a
fresh process group, reads the report this writes to `result_path` (rank suffixed), and turns
signals, timeouts and missing reports into statuses. Everything here applies a knob for real.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from contextlib import nullcontext
from typing import Any, Iterator

from pydantic import BaseModel, ConfigDict, Field

from advisor.procmem import current_rss, mark_peak, peak_rss
from advisor.trial import CompileMode, Environment, PeakMemory, Pinning, TrainingConfig, TrialBudget, TrialStatus

TRACEBACK_LINES = 12  # lines of a traceback kept in a report


class ChildRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    workload: str
    workload_args: dict[str, Any] = Field(default_factory=dict)
    config: TrainingConfig
    budget: TrialBudget
    result_dir: str = Field(description="Where each rank writes rank<N>.json.")
    count_ops: bool = Field(default=True, description="Count dispatched ops in one extra untimed step (eager).")
    inductor_cache_dir: str | None = None


class ChildReport(BaseModel):
    """What one rank measured; the parent merges the ranks into a TrialResult."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    status: TrialStatus
    error: str | None = None
    rank: int = 0
    world_size: int = 1
    warmup_times: list[float] = Field(default_factory=list, description="Each warm-up step (s).")
    step_times: list[float] = Field(default_factory=list, description="Each timed optimizer step (s).")
    data_times: list[float] = Field(default_factory=list, description="Time each timed step waited for batches (s).")
    samples_per_step: int = Field(default=0, description="Samples per optimizer step, all ranks.")
    peak: PeakMemory | None = None
    ops_per_step: int | None = None
    op_overhead_s: float | None = None
    environment: Environment | None = None
    digest: str | None = None
    coords: dict[str, int] | None = Field(default=None, description="tp/pp trials: the rank's index along pp, dp "
                                          "and tp.")
    comm_bytes: dict[str, int] | None = Field(
        default=None, description="tp/pp trials: payload bytes per optimizer step by collective kind "
        "(advisor/parallel/comm.py), counted over the last warm-up step.")
    notes: list[str] = Field(default_factory=list)
    compiled_graphs: int | None = Field(default=None, description="Graphs dynamo captured and inductor compiled.")
    marks: dict[str, float] = Field(default_factory=dict,
                                    description="time.time() at each stage, for the overhead breakdown.")


def _report_path(result_dir: str, rank: int) -> str:
    return os.path.join(result_dir, f"rank{rank}.json")


def _write(report: ChildReport, result_dir: str) -> None:
    path = _report_path(result_dir, report.rank)
    with open(path + ".tmp", "w") as f:
        f.write(report.model_dump_json())
    os.replace(path + ".tmp", path)  # atomic: the parent never reads half a report


class _Stepper:
    """Runs optimizer steps (grad_accum micro-batches each), timing data waits apart from compute."""

    def __init__(self, ctx: Any, batches: Iterator[Any], config: TrainingConfig, device: str) -> None:
        self.ctx, self.batches, self.config, self.device = ctx, batches, config, device

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()

    def step(self, mode: Any = None) -> tuple[float, float]:
        """One optimizer step; returns (wall s, s spent waiting for batches)."""
        from probes.loader import to_device

        c = self.config
        t0 = time.perf_counter()
        data_s = 0.0
        for micro in range(c.grad_accum):
            t = time.perf_counter()
            batch = to_device(next(self.batches), self.device, non_blocking=c.pin_memory, channels_last=c.channels_last)
            data_s += time.perf_counter() - t
            with mode if mode is not None else nullcontext():
                self._train(batch, micro == c.grad_accum - 1)
        self._sync()
        return time.perf_counter() - t0, data_s

    def _train(self, batch: Any, last: bool) -> None:
        """Forward and backward of one micro-batch; the optimizer steps after the `last` one."""
        from advisor.parallel.accumulate import gradient_sync
        from advisor.training import train_step

        with gradient_sync(self.ctx.model, last, keep_gathered=self.config.strategy.keeps_gathered):
            train_step(self.ctx, batch, loss_scale=1.0 / self.config.grad_accum, step=last)


class _ProgramStepper(_Stepper):
    """Steps a tp/pp rank's program (advisor/parallel/program.py): grad_accum batches per optimizer step, each of
    which a pipeline splits into its micro-batches itself; the program holds the data-parallel reduction back
    until the last."""

    def _train(self, batch: Any, last: bool) -> None:
        self.ctx.step(batch, loss_scale=1.0 / self.config.grad_accum, optimizer_step=last)


def _op_overhead_s(device: str, n: int = 2000) -> float:
    """Wall time of dispatching one tiny in-place op here (s): the floor every eager op pays."""
    import torch

    x = torch.zeros(1, device=device)
    for _ in range(50):
        x.add_(1)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def _count_ops(stepper: _Stepper) -> int:
    """ATen ops dispatched in one optimizer step (an extra, untimed one)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
            Counter.count += 1
            return func(*args, **(kwargs or {}))

    stepper.step(mode=Counter())
    return Counter.count


def _setup(req: ChildRequest, rank: int, local_rank: int) -> tuple[Any, list[str]]:
    """Pinning, threads and the process group, before anything large is allocated."""
    import torch

    c, notes, plan = req.config, [], None
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice > 0:  # e.g. a Ray cluster's worker without RAY_worker_niceness=0 (advisor.tune.driver._ray_env)
        notes.append(f"this rank ran at niceness {nice}: any other work on the host took the CPU before it, "
                     "so its figures may be low")
    if c.pinning != Pinning.none:
        from probes.pinning import apply_pinning, plan_pinning

        plan = plan_pinning(c.pinning.value, device_type=c.device, local_rank=local_rank, cpu_list=c.cpu_list)
        apply_pinning(plan, limit_threads=c.threads is None)  # no more threads than pinned CPUs
    if c.threads:
        torch.set_num_threads(c.threads)
    info = None
    if c.nproc > 1:
        from probes.parallel import init_distributed

        info = init_distributed(c.device)
    if plan is not None:
        from probes.pinning import verify_pinning

        drift = verify_pinning(plan)
        if drift:  # a library (e.g. the process group's threads) reset it: pin again, and say so
            from probes.pinning import apply_pinning

            apply_pinning(plan)
            notes.append(f"affinity reset after process-group init ({'; '.join(drift)}); pinned again")
    return (info, plan), notes


def _make_context(workload: Any, c: TrainingConfig, device: str, info: Any) -> Any:
    import torch

    from advisor.finetune import hold_frozen
    from advisor.training import prepare

    model = hold_frozen(workload.build(), c.precision).to(device)  # a frozen base moves in its own dtype
    if c.channels_last:
        model = model.to(memory_format=torch.channels_last)
    wrap = make_opt = compile_fn = None
    if info is not None:
        from probes.parallel import make_trial_optimizer, wrap_model

        def wrap(m):
            return wrap_model(m, c.strategy, info, precision=c.precision, device_type=c.device)

        def make_opt(m):
            return make_trial_optimizer(m, c.strategy, c.optimizer, c.optimizer_impl, info)

    if c.compile_mode != CompileMode.none:
        mode = None if c.compile_mode == CompileMode.default else c.compile_mode.value

        def compile_fn(m):
            return torch.compile(m, mode=mode)

    ctx = prepare(model, workload.loss_fn, precision=c.precision, optimizer=c.optimizer, device_type=c.device,
                  optimizer_impl=c.optimizer_impl, checkpointing=c.checkpointing, fused_backward=c.fused_backward,
                  wrap=wrap, make_opt=make_opt, compile_fn=compile_fn)
    if info is not None and ctx.scaler is not None:  # fp16: FSDP2 ranks must agree on skipped steps
        from probes.parallel import make_grad_scaler

        ctx.scaler = make_grad_scaler(c.strategy, c.device)
    return ctx


def _timed(stepper: _Stepper, budget: TrialBudget) -> tuple[list[float], list[float]]:
    steps: list[float] = []
    waits: list[float] = []
    start = time.perf_counter()
    while len(steps) < budget.max_steps and (len(steps) < budget.min_steps
                                             or time.perf_counter() - start < budget.min_time_s):
        wall, wait = stepper.step()
        steps.append(wall)
        waits.append(wait)
    return steps, waits


def run(req: ChildRequest) -> ChildReport:
    """The measured trial of one rank: build, warm up, count ops, time steps, read the peaks."""
    import torch

    from advisor.training import set_matmul_precision
    from advisor.workload import load_workload
    from probes.environment import environment
    from probes.loader import build_loader, cycle

    marks = {"start": time.time()}
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    c, layout = req.config, req.config.layout()
    (info, plan), notes = _setup(req, rank, local_rank)
    marks["setup"] = time.time()
    world = info.world_size if info is not None else 1
    set_matmul_precision(c.precision)
    workload = load_workload(req.workload, req.workload_args)
    device = f"cuda:{local_rank}" if c.device == "cuda" else "cpu"
    torch.manual_seed(0)
    if c.device == "cuda":
        torch.cuda.set_device(local_rank)
        torch.cuda.reset_peak_memory_stats()
    mark_peak()  # a forked child starts from its fork server's peak (advisor/procmem.py)
    base_rss = current_rss()  # docs/design.md: the resident set just before build_model()
    alloc_log = _start_alloc_log(req, c, layout, rank)
    program = _make_program(workload, c, device, rank) if layout.parallel else None
    ctx = program if program is not None else _make_context(workload, c, device, info)
    marks["built"] = time.time()
    # tp ranks of one replica read the same samples: the loader shards by data-parallel rank, not global rank
    shard, shards = (program.coords["dp"], layout.dp) if program is not None else (rank, world)
    loader = build_loader(workload, c, rank=shard, world_size=shards, worker_init_fn=_worker_init(plan))
    stepper = (_ProgramStepper if program is not None else _Stepper)(ctx, cycle(loader), c, device)
    marks["loader"] = time.time()
    counter = _comm_counter() if program is not None else None
    warmup, ops, allocated = _warm_up(stepper, req, counter, alloc_log)
    marks["warm"] = time.time()
    steps, waits = _timed(stepper, req.budget)
    marks["timed"] = time.time()
    peak = PeakMemory(cpu_rss_bytes=peak_rss() - base_rss, cpu_allocated_bytes=allocated)
    if c.device == "cuda":
        peak = peak.model_copy(update={"cuda_allocated_bytes": torch.cuda.max_memory_allocated(),
                                       "cuda_reserved_bytes": torch.cuda.max_memory_reserved()})
    graphs = None
    if c.compile_mode != CompileMode.none:
        from torch._dynamo.utils import counters

        graphs = int(counters["stats"]["unique_graphs"])
    digest = None
    if info is not None and program is None:  # tp/pp ranks hold different shards and stages: nothing to agree on
        from probes.parallel import param_digest

        digest = param_digest(getattr(ctx.model, "_orig_mod", ctx.model))
    return ChildReport(status=TrialStatus.ok, rank=rank, world_size=world, warmup_times=warmup, step_times=steps,
                       data_times=waits, samples_per_step=c.batch_size * c.grad_accum * shards, peak=peak,
                       ops_per_step=ops, op_overhead_s=_op_overhead_s(device) if ops is not None else None,
                       environment=environment(device), digest=digest, notes=notes, marks=marks,
                       compiled_graphs=graphs, coords=program.coords if program is not None else None,
                       comm_bytes=counter.per_step(1) if counter is not None else None)


def _start_alloc_log(req: ChildRequest, c: TrainingConfig, layout: Any, rank: int) -> str | None:
    """Where a CPU rank of a parallel layout logs its storages (advisor/alloclog.py), logging from now; None where
    the trial is not one or runs without the shim (the fork server preloads it where gcc can build it)."""
    from advisor import alloclog

    if c.device != "cpu" or not layout.parallel or not alloclog.active():
        return None
    path = os.path.join(tempfile.gettempdir(), f"advisor-alloc-{os.getpid()}-{rank}.log")
    return path if alloclog.start(path) else None


def _make_program(workload: Any, c: TrainingConfig, device: str, rank: int) -> Any:
    """This rank's part of a tp/pp run (advisor/parallel/program.py), in the trial's process group."""
    import torch

    from advisor.parallel.program import build_program

    return build_program(workload, c.layout(), rank=rank, device_type=c.device, device=torch.device(device),
                         precision=c.precision, optimizer=c.optimizer, optimizer_impl=c.optimizer_impl,
                         checkpointing=c.checkpointing, batch_size=c.batch_size)


def _worker_init(plan: Any) -> Any:
    if plan is None:
        return None
    from probes.pinning import worker_init_fn

    return worker_init_fn(plan)


def _comm_counter() -> Any:
    from advisor.parallel.comm import CommCounter

    return CommCounter()


def _warm_up(stepper: _Stepper, req: ChildRequest, counter: Any,
             alloc_log: str | None = None) -> tuple[list[float], int | None, int | None]:
    """Warm-up steps (excluded from timing): their times, the ops the last one dispatched (eager runs; else
    None), and the live tensor bytes' peak over the build and the plain steps where `alloc_log` is being written
    (advisor/alloclog.py; at least two plain steps then, the second with the optimizer state held). With
    `counter`, the last step also counts its collectives' bytes: one optimizer step's."""
    plain = max(req.budget.warmup_steps - 1, 2 if alloc_log else 0)
    warmup = [stepper.step()[0] for _ in range(plain)]
    allocated = None
    if alloc_log is not None:  # before the counted step: its dispatch mode moves some frees
        from advisor import alloclog

        alloclog.stop()
        allocated = alloclog.replay(alloc_log)
        os.unlink(alloc_log)
    ops = None
    t = time.perf_counter()
    with counter.counting() if counter is not None else nullcontext():
        if req.count_ops and req.config.compile_mode == CompileMode.none:
            ops = _count_ops(stepper)
        else:
            stepper.step()
    warmup.append(time.perf_counter() - t)
    return warmup, ops, allocated


def _failure(exc: BaseException, rank: int) -> ChildReport:
    import torch

    tail = "".join(traceback.format_exception(exc)).rstrip().splitlines()[-TRACEBACK_LINES:]
    head = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
    oom = isinstance(exc, (MemoryError, torch.OutOfMemoryError))
    return ChildReport(status=TrialStatus.oom if oom else TrialStatus.error, error="\n".join([head, *tail]), rank=rank)


def entry(path: str, log_path: str) -> None:
    """Start of a rank forked from the warm fork server (probes/forkserver.py; torch already imported).

    The rank leads a new session and process group (so the runner can kill it and its DataLoader
    workers together) and writes its output to `log_path`; the server set its environment.
    """
    from advisor.isolation.forkserver import own_group

    own_group(log_path, os.O_TRUNC)
    main(path)


def main(path: str) -> int:
    with open(path) as f:
        req = ChildRequest.model_validate_json(f.read())
    if req.inductor_cache_dir:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", req.inductor_cache_dir)
    rank = int(os.environ.get("RANK", 0))
    try:
        report = run(req)
    except BaseException as exc:  # noqa: BLE001 - every failure of a trial is a recorded result
        report = _failure(exc, rank)
    _write(report, req.result_dir)
    try:
        from probes.parallel import shutdown_distributed

        shutdown_distributed()
    except ImportError:
        pass
    sys.stdout.flush()
    # Skip interpreter teardown: DataLoader workers and process groups are gone or the parent kills
    # the group; a slow or crashing teardown must not turn a measured trial into a failure.
    os._exit(0 if report.status == TrialStatus.ok else 1)


if __name__ == "__main__":
    main(sys.argv[1])

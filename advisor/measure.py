"""Real CPU memory measurement of a few training steps, in a fresh process (docs/design.md's protocol).

`rss`: the peak resident set over the resident set just before build_model(), after `steps` >= 2
optimizer steps (the kernel's high-water mark reset before the build; see advisor/procmem.py). `alloc`:
the exact peak of live tensor bytes from the profiler's memory events, in a separate run under a fixed
glibc mmap threshold (PROFILED_MMAP_THRESHOLD), as the profiler's buffers would inflate the resident set.
`trace`: the estimator's tracer on real tensors, its allocation log written to a file (calibration).
`cuda`: the steps on the GPU, max_memory_allocated / max_memory_reserved.
Run as `python -m advisor.measure '<json request>'`; prints one JSON line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from advisor.config import Checkpointing, OptimizerKind, Precision
from advisor.errors import TrialError
from advisor.procmem import MMAP_THRESHOLD_MAX, current_rss, malloc_env, mark_peak, peak_rss

# glibc's mmap threshold in `alloc` mode (bytes; the live tensor bytes it measures do not depend on it). Under the
# dynamic default, which rises to the largest mapped chunk freed, a profiled run's heap grows with the batch
# (bench/workloads/fresh4.py:tagger at batch 24: 23.1 GB resident, 1.2 GB with the threshold at 1 MiB).
PROFILED_MMAP_THRESHOLD = 1 << 20


class MeasureRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    workload: str
    workload_args: dict[str, Any] = Field(default_factory=dict)
    batch_size: int = Field(gt=0)
    precision: Precision = Precision.fp32
    optimizer: OptimizerKind = OptimizerKind.adamw
    checkpointing: Checkpointing = Checkpointing.none
    fused_backward: bool = False
    optimizer_impl: Literal["for-loop", "foreach", "fused"] | None = Field(default=None,
                                                                           description="None: torch's default.")
    steps: int = Field(default=3, ge=2)
    mode: str = Field(default="rss", pattern="^(rss|alloc|trace|cuda)$")
    trace_path: str | None = Field(default=None,
                                   description="mode 'trace': where to write the real-tensor trace (.npz).")
    threads: int | None = Field(default=None, gt=0)
    mmap_threshold: int | None = Field(
        default=None, gt=0, le=MMAP_THRESHOLD_MAX,
        description="glibc's mmap threshold for the run (bytes), fixed through MALLOC_MMAP_THRESHOLD_ before the "
        "process starts, with the trim threshold at twice it (glibc's own ratio); None: glibc's dynamic default.")
    heap_log: str | None = Field(
        default=None, description="mode 'rss': a file to log every allocation and free of the build and steps to "
        "(advisor.estimate.resident.heaplog), where its logger could be built here; the log is not counted in the "
        "resident set.")
    memory_cap_bytes: int | None = Field(
        default=None, gt=0, description="A ceiling on the run's private writable memory (RLIMIT_DATA, bytes): a run "
        "that would outgrow it fails with a message, where without it the host's OOM killer picks a process to kill "
        "(not always this one); None: no ceiling.")


class MeasureResult(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    request: MeasureRequest
    rss_delta_bytes: int | None = Field(default=None, description="Peak RSS over RSS before build_model (bytes).")
    baseline_rss_bytes: int | None = None
    alloc_peak_bytes: int | None = Field(default=None, description="Exact peak of live tensor bytes (bytes).")
    cuda_reserved_bytes: int | None = Field(default=None, description="mode 'cuda': max_memory_reserved (bytes).")
    cuda_context_bytes: int | None = Field(
        default=None, description="mode 'cuda': device memory this process holds outside the caching allocator (the "
        "context, kernels, library handles), from NVML, after the steps (bytes); None where NVML cannot say.")
    seconds: float


def memory_events(prof) -> list[int]:
    """The profiler's CPU [memory] events in time order: bytes allocated (+) or freed (-)."""
    # The kineto results hold every allocator report, in order; prof.events() folds most into ops.
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type().name == "CPU"]
    events.sort(key=lambda e: e.start_ns())
    return [int(e.nbytes()) for e in events]


def replay_memory_events(prof) -> tuple[int, int]:
    """(peak, final) of the running sum of the profiler's CPU [memory] events in time order (bytes)."""
    live = peak = 0
    for n in memory_events(prof):
        live += n
        peak = max(peak, live)
    return peak, live


def _to_device(batch: Any, device: str) -> Any:
    if device == "cpu":
        return batch
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.to(device, non_blocking=True) if hasattr(x, "to") else x, batch)


def _nvml_bytes_of_this_process() -> int | None:
    """Device memory NVML counts for this process, over the GPUs it sees (bytes), or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            held = [int(proc.usedGpuMemory) for i in range(pynvml.nvmlDeviceGetCount())
                    for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i))
                    if proc.pid == os.getpid() and proc.usedGpuMemory]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML, or a driver that hides per-process figures
        return None
    return sum(held) if held else None


def _run(req: MeasureRequest) -> MeasureResult:
    import torch

    from advisor.finetune import hold_frozen
    from advisor.training import prepare, train_step
    from advisor.workload import load_workload

    if req.threads:
        torch.set_num_threads(req.threads)
    workload = load_workload(req.workload, req.workload_args)
    torch.manual_seed(0)
    t0 = time.perf_counter()

    device = "cuda" if req.mode == "cuda" else "cpu"

    def steps(phase: Callable[[str], None] | None = None) -> None:
        """The build and `req.steps` steps; `phase` is told each step's phases as the tracer marks them
        (trace.STEP_PHASES: "batch" before its batch is made, then what train_step tells it)."""
        model = hold_frozen(workload.build(), req.precision).to(device)  # a frozen base moves in its own dtype
        ctx = prepare(model, workload.loss_fn, precision=req.precision, optimizer=req.optimizer, device_type=device,
                      optimizer_impl=req.optimizer_impl, checkpointing=req.checkpointing,
                      fused_backward=req.fused_backward)
        for _ in range(req.steps):
            if phase is not None:
                phase("batch")
            batch = _to_device(workload.make_batch(req.batch_size), device)
            train_step(ctx, batch, phase)

    if req.mode == "trace":
        from advisor.estimate.trace import save_trace, trace_training

        tr = trace_training(workload, req.batch_size, precision=req.precision, optimizer=req.optimizer,
                            checkpointing=req.checkpointing, fused_backward=req.fused_backward, fake=False)
        save_trace(tr, req.trace_path or "trace.npz")
        return MeasureResult(request=req, alloc_peak_bytes=tr.peak_bytes, seconds=time.perf_counter() - t0)
    if req.mode == "cuda":
        # docs/design.md: peaks over the steps, after reset_peak_memory_stats() taken before the build.
        from advisor.training import set_matmul_precision

        set_matmul_precision(req.precision)
        torch.cuda.reset_peak_memory_stats()
        steps()
        torch.cuda.synchronize()
        held = _nvml_bytes_of_this_process()
        return MeasureResult(request=req, alloc_peak_bytes=torch.cuda.max_memory_allocated(),
                             cuda_reserved_bytes=torch.cuda.max_memory_reserved(),
                             cuda_context_bytes=None if held is None else held - torch.cuda.memory_reserved(),
                             seconds=time.perf_counter() - t0)
    if req.mode == "rss":
        heap = None
        if os.environ.get("ADVISOR_HEAP_LOG"):  # heaplog.LOG_ENV, set by measure() for a logged run
            from advisor.estimate.resident import heaplog as heap
        mark_peak()
        base = current_rss()
        # a fixed buffer: the records go to the file, not the resident set
        logged = heap is not None and heap.start_logging()
        steps(heap.phase_marks() if logged else None)
        peak = peak_rss()
        if logged:
            heap.stop_logging()
        return MeasureResult(request=req, rss_delta_bytes=peak - base, baseline_rss_bytes=base,
                             seconds=time.perf_counter() - t0)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        steps()
    return MeasureResult(request=req, alloc_peak_bytes=replay_memory_events(prof)[0], seconds=time.perf_counter() - t0)


def child_env(req: MeasureRequest, beside_another: bool = False) -> dict[str, str]:
    """The environment of `req`'s fresh process: glibc's thresholds (procmem.malloc_env; in `alloc` mode
    PROFILED_MMAP_THRESHOLD where the request fixes none), the heap logger's
    preload where `req` logs its heap, and, `beside_another` (another measurement runs at the same time on
    this host's cores, as the calibration's go two at once, each with torch's default thread count: more
    threads than cores), OpenMP threads that wait passively (OMP_WAIT_POLICY=PASSIVE, where no policy was
    set). libgomp's default spins at every barrier, and a spinning thread burns the core that the thread it
    waits on, in the other process, needs. The policy allocates nothing; it saves the time of workloads of many
    small ops (bench/workloads/fresh4.py:tagger, an LSTM stepped one time step at a time)."""
    env = malloc_env(req.mmap_threshold or (PROFILED_MMAP_THRESHOLD if req.mode == "alloc" else None))
    if req.heap_log is not None and req.mode == "rss":
        from advisor.estimate.resident import heaplog

        if heaplog.tools() is not None:
            env = heaplog.run_env(req.heap_log, env)
    if beside_another:
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def measure(req: MeasureRequest, timeout_s: float = 600.0, *, beside_another: bool = False) -> MeasureResult:
    """Run `req` in a fresh Python process (its environment: `child_env`) and return its measurement."""
    cmd = [sys.executable, "-m", "advisor.measure", req.model_dump_json()]
    env = child_env(req, beside_another)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False, env=env)
    except subprocess.TimeoutExpired as exc:
        raise TrialError(f"measurement of {req.workload} at batch {req.batch_size} timed out after "
                         f"{timeout_s:.0f} s") from exc
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise TrialError(f"measurement of {req.workload} at batch {req.batch_size} failed "
                         f"(exit {proc.returncode}): {tail[0]}")
    return MeasureResult.model_validate_json(proc.stdout.strip().splitlines()[-1])


def _main(req: MeasureRequest) -> int:
    """Run `req` under its memory cap; print its result (stdout) or, where it outgrew the cap, one line
    saying so (stderr, exit 3)."""
    if req.memory_cap_bytes is not None:
        import resource

        resource.setrlimit(resource.RLIMIT_DATA, (req.memory_cap_bytes, req.memory_cap_bytes))
    try:
        result = _run(req)
    except (MemoryError, RuntimeError) as exc:
        # torch's CPU allocator raises RuntimeError "... can't allocate memory ..." where malloc fails
        if req.memory_cap_bytes is None or not (isinstance(exc, MemoryError) or "allocate memory" in str(exc)):
            raise
        print(f"it outgrew its memory cap of {req.memory_cap_bytes / 1e9:.2f} GB ({str(exc).splitlines()[0][:200]})",
              file=sys.stderr)
        return 3
    print(result.model_dump_json())
    return 0


if __name__ == "__main__":
    sys.exit(_main(MeasureRequest.model_validate_json(sys.argv[1])))

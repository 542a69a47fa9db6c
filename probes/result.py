"""TrialResult: what one measured trial reports, whatever happened to it."""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from probes.config import TrainingConfig


class TrialStatus(str, Enum):
    ok = "ok"
    oom = "oom"  # CUDA out of memory; on the CPU, past the trial's memory cap
    timeout = "timeout"  # hung or too slow: the whole process group was killed
    crashed = "crashed"  # killed by a signal (SIGSEGV, SIGABRT, ...), named in `error`
    error = "error"  # an exception in the workload's code or ours; `error` has the traceback's tail
    invalid = "invalid"  # a knob that cannot apply on this target; nothing was launched


class StepTimes(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    p50: float = Field(description="Median optimizer-step time (s).")
    p90: float = Field(description="90th percentile optimizer-step time (s).")
    mean: float = Field(description="Mean optimizer-step time (s).")


class PeakMemory(BaseModel):
    """Measured peaks (DESIGN.md): per process of rank 0; None where not measurable on this device."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu_rss_bytes: int | None = Field(default=None, description="Peak RSS over RSS before build_model (bytes).")
    cuda_allocated_bytes: int | None = Field(default=None, description="torch.cuda.max_memory_allocated (bytes).")
    cuda_reserved_bytes: int | None = Field(default=None, description="torch.cuda.max_memory_reserved (bytes).")


class Bottleneck(BaseModel):
    """Where the step's time goes, with the numbers the verdict rests on."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    verdict: Literal["input-bound", "compute-bound", "overhead-bound"]
    reason: str = Field(description="One line: the numbers and what would help.")
    data_wait_fraction: float = Field(description="Share of step time spent waiting for the next batch.")
    ops_per_step: int | None = Field(default=None, description="ATen ops dispatched per optimizer step (eager runs).")
    op_overhead_s: float | None = Field(default=None, description="Measured cost of dispatching one tiny op here (s).")
    dispatch_fraction: float | None = Field(default=None, description="ops_per_step x op_overhead_s over compute time.")
    achieved_tflops: float | None = Field(default=None, description="Traced FLOPs per step over step time (TFLOP/s).")


class Environment(BaseModel):
    """What the numbers were measured with, so results from elsewhere are not mixed up."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    torch: str
    python: str
    platform: str
    cpu_model: str
    cpu_count: int
    intra_op_threads: int
    cuda: str | None = None
    driver: str | None = None
    device_name: str
    niceness: int | None = Field(default=None, description="The rank's scheduling niceness (0 unless lowered: a Ray "
                                 "worker's is 15 unless the cluster sets RAY_worker_niceness=0); None: not recorded.")


class TrialResult(BaseModel):
    """One trial's outcome. Figures are for the whole job (all ranks) unless said per rank."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    status: TrialStatus
    error: str | None = Field(default=None, description="What went wrong: one line, then the traceback's tail where there is one.")
    workload: str
    hardware: str
    config: TrainingConfig
    samples_per_s: float | None = Field(default=None, description="Samples per second over the timed window, all ranks.")
    others_busy: float | None = Field(default=None, ge=0, le=1, description="Share of the machine's CPU time other work "
                                      "took just before the trial started (/proc/stat over 0.25 s, the last look of up "
                                      "to settle_s waiting for quiet); over quiet_cpu_fraction, a note says its figures "
                                      "may be several times low. None: not looked (settle_s 0).")
    tokens_per_s: float | None = Field(default=None, description="samples_per_s x tokens_per_sample, where the workload says.")
    step_time_s: StepTimes | None = None
    data_wait_fraction: float | None = Field(default=None, description="Share of the timed window spent waiting for batches.")
    peak_memory_bytes: int | None = Field(default=None, description="The DESIGN.md peak: cuda reserved on GPUs, cpu_rss on the CPU (bytes).")
    peak_memory: PeakMemory | None = None
    predicted_memory_bytes: int | None = Field(default=None, description="The estimator's total_bytes for this config (bytes).")
    predicts: str | None = Field(default=None, description="Which measured quantity predicted_memory_bytes predicts.")
    protocol_peak_bytes: int | None = Field(
        default=None, description="CPU: DESIGN.md's resident-set peak of one fresh-process run at this config's batch, "
        "run after the trial and kept as a measured peak (TrialBudget.record_peak); None where none ran (bytes).")
    compile_s: float | None = Field(default=None, description="Warm-up time beyond ordinary steps, spent compiling (s).")
    compiled_graphs: int | None = Field(default=None, description="Graphs torch.compile captured and compiled (compiled runs).")
    warmup_s: float | None = Field(default=None, description="Warm-up steps' wall time (s).")
    measured_s: float | None = Field(default=None, description="The timed window (s).")
    measured_steps: int | None = None
    mfu: float | None = Field(default=None, description="Traced FLOPs/s over the hardware's dense peak for the precision.")
    bottleneck: Bottleneck | None = None
    environment: Environment | None = None
    wall_s: float = Field(default=0.0, description="The whole trial as the caller saw it (s).")
    overhead_s: float | None = Field(default=None, description="wall_s less warm-up and timed window (s).")
    build_s: float | None = Field(default=None, description="Part of overhead_s: building, wrapping and compiling-wrapping the model, and the optimizer (s).")
    notes: list[str] = Field(default_factory=list)
    rank_digests: list[str] = Field(default_factory=list, description="Per rank: a hash of the parameters after the last step.")

    @property
    def ok(self) -> bool:
        return self.status == TrialStatus.ok

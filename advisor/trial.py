"""The shared trial types: what one measured trial sets (TrainingConfig), how long it measures
(TrialBudget), what it reports (TrialResult), and whether a configuration applies on a target at all."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from advisor.config import CHECKPOINTING_DOC, Checkpointing, OptimizerKind, Precision, Strategy
from advisor.parallel.layout import Layout, PipelineSchedule, layout_problems, structural_problems

if TYPE_CHECKING:
    from advisor.hardware.spec import HardwareSpec
    from advisor.workload import Workload, WorkloadInfo

# How long a process leaving a gloo group hands the GIL to gloo's workers (s): a worker frees each finished
# collective under the GIL, and one still waiting for it at interpreter shutdown is ended mid-free (SIGABRT at
# exit, torch 2.13). Trial ranks and exported scripts both pause so; a process leaving through os._exit need not.
GLOO_EXIT_PAUSE_S = 0.2
RANK_FAILURE_GRACE_S = 5.0  # after one rank fails, the others get this long before their groups are killed (s)


class CompileMode(str, Enum):
    none = "none"  # eager
    default = "default"
    reduce_overhead = "reduce-overhead"  # CUDA graphs
    max_autotune = "max-autotune"  # autotuned kernels + CUDA graphs
    max_autotune_no_cudagraphs = "max-autotune-no-cudagraphs"

    @property
    def uses_cudagraphs(self) -> bool:
        return self in (CompileMode.reduce_overhead, CompileMode.max_autotune)


class Pinning(str, Enum):
    none = "none"  # the OS schedules freely
    node = "node"  # the CPUs local to the device (NVML affinity, PCI local_cpulist, or a NUMA node)
    cpus = "cpus"  # an explicit cpulist (cpu_list)


class TrainingConfig(BaseModel):
    """Every knob of one trial (docs/design.md). Structural rules are checked here; what depends on the
    target (a CUDA-only knob on a CPU) is checked by `inapplicable`, so the tuner can record it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: Literal["cpu", "cuda"] = Field(default="cpu", description="Where the model trains.")
    batch_size: int = Field(default=8, gt=0, description="Micro-batch per process (samples); with tp, per "
                            "data-parallel replica (its tp ranks read the same samples); with pp, the step's samples "
                            "per data-parallel replica, split into `microbatches` micro-batches.")
    grad_accum: int = Field(default=1, ge=1, description="Batches of batch_size per optimizer step, their gradients "
                            "accumulated (with pp, each split into the pipeline's micro-batches).")
    num_workers: int = Field(default=0, ge=0, description="DataLoader worker processes per rank.")
    pin_memory: bool = Field(default=False, description="DataLoader returns page-locked batches (CUDA only).")
    prefetch_factor: int | None = Field(default=None, ge=1, description="Batches loaded ahead per worker.")
    persistent_workers: bool = Field(default=False, description="Workers survive between epochs.")
    precision: Precision = Precision.fp32
    compile_mode: CompileMode = CompileMode.none
    optimizer: OptimizerKind = OptimizerKind.adamw
    optimizer_impl: Literal["for-loop", "foreach", "fused"] | None = Field(
        default=None, description="None: torch's default.")
    fused_backward: bool = Field(
        default=False, description="Optimizer step in each parameter's post-accumulate-grad hook.")
    checkpointing: Checkpointing = Field(default=Checkpointing.none, description=CHECKPOINTING_DOC)
    channels_last: bool = Field(default=False, description="NHWC memory format for the model and 4-D inputs.")
    strategy: Strategy = Field(
        default=Strategy.single, description="single, ddp, zero1 (DDP + sharded optimizer), zero2/zero3 (FSDP2).")
    nproc: int = Field(default=1, ge=1, description="Processes (one per device): dp x cp x tp x pp.")
    tp: int = Field(default=1, ge=1, description="Tensor-parallel ranks: each layer's heads and FFN split across them.")
    pp: int = Field(default=1, ge=1, description="Pipeline ranks: the layers cut into consecutive stages.")
    cp: int = Field(default=1, ge=1, description="Context-parallel ranks: each sequence split across them, attention's "
                    "keys and values passed around a ring.")
    dp_replicate: int = Field(default=1, ge=1, description="HSDP: data-parallel groups, each sharding the model "
                              "within itself (zero2/zero3), gradients all-reduced across them.")
    pp_schedule: PipelineSchedule = Field(default=PipelineSchedule.one_f_one_b, description="Pipeline schedule: "
                                          "gpipe, 1f1b or interleaved-1f1b (with virtual_stages >= 2).")
    microbatches: int | None = Field(default=None, ge=1, description="Micro-batches per step through the pipeline; "
                                     "None: batch_size / micro_batch_size where that is given, else pp x "
                                     "virtual_stages.")
    micro_batch_size: int | None = Field(default=None, ge=1, description="Samples per pipeline micro-batch: the "
                                         "other way to give microbatches (batch_size / micro_batch_size); None: "
                                         "from microbatches.")
    virtual_stages: int = Field(default=1, ge=1, description="Pipeline stages per pp rank (interleaved-1f1b).")
    stage_layers: tuple[int, ...] | None = Field(default=None, description="Layers of each pipeline stage, first to "
                                                 "last; None: as even as the layers allow.")
    sequence_parallel: bool = Field(default=True, description="With tp: norms and residuals sharded along the "
                                    "sequence between tensor-parallel regions.")
    pinning: Pinning = Pinning.none
    cpu_list: str | None = Field(default=None, description="pinning=cpus: a cpulist such as '0-3,8'.")
    threads: int | None = Field(default=None, gt=0, description="Intra-op threads per process (None: torch's default).")
    lora_r: int | None = Field(default=None, ge=1, le=65536, description="Rank of the LoRA adapters of a workload "
                               "fine-tuned with LoRA (advisor/finetune.py); None: the rank its fine-tune gives.")

    @model_validator(mode="after")
    def _structural(self) -> "TrainingConfig":
        problems = _structural_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def layout(self) -> Layout:
        """How the nproc ranks split the work: dp = nproc / (tp x pp x cp) replicas held by `strategy`, tp, pp, cp."""
        return Layout(**_layout_fields(self))

    def changes(self) -> dict[str, Any]:
        """The knobs that differ from PyTorch's defaults (for compact display)."""
        base = TrainingConfig(device=self.device, batch_size=self.batch_size)
        return {k: v for k, v in self.model_dump(mode="json").items() if getattr(base, k) != getattr(self, k)}


def _layout_fields(c: TrainingConfig) -> dict[str, Any]:
    return dict(dp=c.nproc // model_ranks(c), tp=c.tp, pp=c.pp, cp=c.cp, dp_replicate=c.dp_replicate,
                strategy=c.strategy, schedule=c.pp_schedule,
                microbatches=pipeline_microbatches(c.batch_size, c.microbatches, c.micro_batch_size)[0],
                virtual_stages=c.virtual_stages, stage_layers=c.stage_layers,
                sequence_parallel=c.sequence_parallel)


def pipeline_microbatches(batch_size: int | None, microbatches: int | None,
                          micro_batch_size: int | None) -> tuple[int | None, str | None]:
    """(micro-batches per pipeline step: `microbatches`, else batch_size / micro_batch_size; None where neither
    says, the layout's default; why micro_batch_size cannot split the batch, in one line, or None). A batch not
    known yet (None) is taken to split."""
    if micro_batch_size is None or batch_size is None:
        return microbatches, None
    if batch_size % micro_batch_size:
        return microbatches, (f"micro_batch_size {micro_batch_size} does not divide batch_size {batch_size}; give a "
                              "divisor of the batch")
    if microbatches is not None and microbatches * micro_batch_size != batch_size:
        return microbatches, (f"microbatches {microbatches} x micro_batch_size {micro_batch_size} != batch_size "
                              f"{batch_size}; give one of the two (micro_batch_size = batch_size / microbatches)")
    return batch_size // micro_batch_size, None


def model_ranks(c: TrainingConfig) -> int:
    """Ranks one copy of the model spans: tp x pp x cp (nproc is dp of these)."""
    return c.tp * c.pp * c.cp


def runs_layout(c: TrainingConfig) -> bool:
    """Whether the trial runs the parallel rank program (advisor/parallel): tp, pp, cp or HSDP."""
    return model_ranks(c) > 1 or c.dp_replicate > 1


def _structural_problems(c: TrainingConfig) -> list[str]:
    out = _parallel_problems(c) if runs_layout(c) else []
    if c.num_workers == 0 and c.prefetch_factor is not None:
        out.append("prefetch_factor needs num_workers >= 1")
    if c.num_workers == 0 and c.persistent_workers:
        out.append("persistent_workers needs num_workers >= 1")
    if (c.pinning == Pinning.cpus) != (c.cpu_list is not None):
        out.append("cpu_list is given exactly when pinning is 'cpus'")
    if not runs_layout(c) and c.strategy == Strategy.single and c.nproc != 1:
        out.append(f"strategy single runs 1 process, not {c.nproc}; use ddp, zero1, zero2 or zero3 for more")
    if not runs_layout(c) and c.strategy != Strategy.single and c.nproc < 2:
        out.append(f"strategy {c.strategy.value} needs nproc >= 2")
    if c.fused_backward and c.grad_accum > 1:
        out.append("fused_backward steps in every backward, so it cannot accumulate gradients (grad_accum must be 1)")
    if c.fused_backward and c.precision == Precision.fp16:
        out.append("fused_backward steps inside backward, before a grad scaler could unscale fp16 gradients; "
                   "use bf16 or fp32")
    if c.fused_backward and c.strategy != Strategy.single:
        # DDP's reducer reads .grad after accumulation; a hook that steps and frees it races it.
        out.append("fused_backward runs with strategy single only")
    if c.optimizer == OptimizerKind.rowwise_adagrad and c.optimizer_impl is not None:
        out.append("rowwise-adagrad has one implementation; leave optimizer_impl unset")
    pipeline_knobs = [k for k in ("pp_schedule", "microbatches", "micro_batch_size", "virtual_stages", "stage_layers")
                      if getattr(c, k) != TrainingConfig.model_fields[k].default]
    if c.pp == 1 and pipeline_knobs:
        out.append(f"pipeline knob(s) {', '.join(pipeline_knobs)} need pp > 1; set pp or leave them unset")
    return out


def _parallel_problems(c: TrainingConfig) -> list[str]:
    """With tp, pp or cp > 1, or HSDP: the mesh, the layout's own rules, and the knobs a rank program does not run."""
    ranks = model_ranks(c)
    if c.nproc % ranks:
        return [f"nproc {c.nproc} is not a multiple of tp x pp x cp = {ranks}; give nproc = dp x {ranks} "
                "(dp: data-parallel replicas, 1 or more)"]
    # Unvalidated: each field was checked here already, and its rules are reported below, one line each.
    why = pipeline_microbatches(c.batch_size, c.microbatches, c.micro_batch_size)[1] if c.pp > 1 else None
    out = ([why] if why else []) + structural_problems(Layout.model_construct(**_layout_fields(c)))
    if c.fused_backward:
        out.append("fused_backward runs with tp = pp = 1 only: a tp/pp rank steps its optimizer after backward")
    if c.compile_mode != CompileMode.none:
        out.append(f"compile_mode {c.compile_mode.value} is not applied to tp/pp rank programs; "
                   "use compile_mode none with tp or pp > 1")
    if c.pp > 1 and c.precision == Precision.fp16:
        out.append("fp16 with pp is not supported (its loss scaler would need every stage's inf check); use bf16")
    return out


def inapplicable(config: TrainingConfig, hardware: "HardwareSpec",
                 workload: "Workload | WorkloadInfo | None" = None) -> str | None:
    """Why `config` cannot run on `hardware` (one line), or None when it can. With `workload`, also why its
    model cannot take the config's tp/pp layout (heads tp does not divide, more stages than layers, ...)."""
    acc = hardware.accelerator
    if config.device != hardware.device_type:
        return f"device {config.device} does not match the hardware {acc.name} ({hardware.device_type})"
    if config.device == "cpu":
        if config.precision in (Precision.fp16, Precision.tf32):
            return f"precision {config.precision.value} needs a CUDA device (fp16 autocast and tf32 are GPU paths)"
        if config.compile_mode.uses_cudagraphs:
            return f"compile mode {config.compile_mode.value} uses CUDA graphs, which need a CUDA device"
        if config.pin_memory:
            return "pin_memory needs a CUDA device (page-locked memory speeds host-to-device copies only)"
    else:
        if config.nproc > hardware.devices_per_node:
            return f"nproc {config.nproc} exceeds the {hardware.devices_per_node} device(s) of {acc.name}"
        if config.precision == Precision.tf32 and not acc.supports_tf32:
            return f"{acc.name} has no tf32 tensor cores"
        if config.precision == Precision.fp16 and not acc.supports_fp16:
            return f"{acc.name} does not support fp16"
    if config.precision in (Precision.bf16, Precision.bf16_pure) and not acc.supports_bf16:
        return f"{acc.name} does not support bf16"
    if config.channels_last and workload is not None and not workload.conv_net:
        return f"channels_last applies to convolutional nets; {workload.name} is not one"
    if workload is not None and runs_layout(config):
        problems = layout_problems(config.layout(), world=config.nproc, decoder=workload.decoder,
                                   model_name=workload.name, batch_size=config.batch_size)
        return problems[0] if problems else None
    return None


def trial_hardware(hw: "HardwareSpec", c: TrainingConfig) -> "HardwareSpec":
    """`hw` as one trial of `c` uses it: its nproc devices (or CPU ranks) on one node. The estimate of a
    config and the measured peaks of it both describe that world, not the whole machine's."""
    return hw.model_copy(update={"devices_per_node": c.nproc, "nodes": 1})


def estimate_request(c: TrainingConfig):
    """The estimator's request (advisor.estimate.model.EstimateRequest) for this config's memory knobs."""
    from advisor.estimate.model import EstimateRequest

    return EstimateRequest(batch_size=c.batch_size, precision=c.precision, optimizer=c.optimizer, strategy=c.strategy,
                           checkpointing=c.checkpointing, fused_backward=c.fused_backward,
                           optimizer_impl=c.optimizer_impl)


class TrialBudget(BaseModel):
    """How a trial measures: warm-up excluded, then timed steps until both minimums are met."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    warmup_steps: int = Field(default=3, ge=1, description="Optimizer steps before timing (compile happens here).")
    min_steps: int = Field(default=10, ge=1, description="At least this many timed optimizer steps.")
    min_time_s: float = Field(default=2.0, ge=0, description="At least this long timed (s).")
    max_steps: int = Field(
        default=10_000, ge=1, description="Stop timing after this many steps even if min_time_s is not reached.")
    timeout_s: float = Field(
        default=600.0, gt=0, description="The whole trial, process start to result (s); then it is killed.")
    memory_cap_bytes: int | None = Field(
        default=None, gt=0,
        description="CPU: kill and report oom past this resident set of the trial's processes (bytes).")
    settle_s: float = Field(
        default=5.0, ge=0, description="Wait up to this long for the machine to go quiet before starting (s).")
    quiet_cpu_fraction: float = Field(
        default=0.3, gt=0, le=1, description="Busier than this share of all CPUs is not quiet.")
    record_peak: Literal["auto", "always", "never"] = Field(
        default="auto", description="CPU, one process, eager: after an ok trial, run docs/design.md's peak protocol "
        "once in a fresh process at the same batch and keep it as a measured peak that refines the estimator "
        "(seconds more; see probes/protocol.py). 'auto': only where the trial's peak (measured or predicted) is 1/8 "
        "or more of its memory and no such peak of this configuration lies near its batch yet.")

    @model_validator(mode="after")
    def _check(self) -> "TrialBudget":
        if self.max_steps < self.min_steps:
            raise ValueError(f"max_steps {self.max_steps} is below min_steps {self.min_steps}")
        return self


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
    """Measured peaks (docs/design.md): per process of rank 0; None where not measurable on this device."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu_rss_bytes: int | None = Field(default=None, description="Peak RSS over RSS before build_model (bytes).")
    cpu_allocated_bytes: int | None = Field(
        default=None, description="A CPU rank of a parallel layout: the peak of every thread's live tensor bytes over "
        "the build and two warm-up steps (advisor/alloclog.py); None without gcc to build the logger (bytes).")
    cuda_allocated_bytes: int | None = Field(default=None, description="torch.cuda.max_memory_allocated (bytes).")
    cuda_reserved_bytes: int | None = Field(default=None, description="torch.cuda.max_memory_reserved (bytes).")


class RankFigures(BaseModel):
    """One rank of a tensor- or pipeline-parallel trial: where it sits in the mesh, what it measured, and what
    the per-rank estimate (advisor.estimate.parallel) said of it; None where no estimate was made."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(ge=0)
    coords: dict[str, int] = Field(description="The rank's index along pp, dp and tp.")
    peak: PeakMemory = Field(description="This rank's measured peaks.")
    comm_bytes: dict[str, int] = Field(
        default_factory=dict, description="Payload bytes per optimizer step by collective kind "
        "(advisor/parallel/comm.py), counted over one warm-up step.")
    predicted_allocated_bytes: int | None = Field(default=None, description="Estimated peak of live tensors (bytes).")
    predicted_total_bytes: int | None = Field(default=None, description="Estimated device memory (bytes).")
    predicted_comm_bytes: dict[str, int] | None = Field(
        default=None, description="Estimated payload bytes per optimizer step by collective kind.")


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
    error: str | None = Field(
        default=None, description="What went wrong: one line, then the traceback's tail where there is one.")
    workload: str
    hardware: str
    config: TrainingConfig
    samples_per_s: float | None = Field(
        default=None, description="Samples per second over the timed window, all ranks.")
    others_busy: float | None = Field(
        default=None, ge=0, le=1, description="Share of the machine's CPU time other work took just before the trial "
        "started (/proc/stat over 0.25 s, the last look of up to settle_s waiting for quiet); over "
        "quiet_cpu_fraction, a note says its figures may be several times low. None: not looked (settle_s 0).")
    tokens_per_s: float | None = Field(
        default=None, description="samples_per_s x tokens_per_sample, where the workload says.")
    step_time_s: StepTimes | None = None
    data_wait_fraction: float | None = Field(
        default=None, description="Share of the timed window spent waiting for batches.")
    peak_memory_bytes: int | None = Field(
        default=None, description="The docs/design.md peak: cuda reserved on GPUs, cpu_rss on the CPU (bytes).")
    peak_memory: PeakMemory | None = None
    predicted_memory_bytes: int | None = Field(
        default=None, description="The estimator's total_bytes for this config (bytes).")
    predicts: str | None = Field(default=None, description="Which measured quantity predicted_memory_bytes predicts.")
    protocol_peak_bytes: int | None = Field(
        default=None, description="CPU: docs/design.md's resident-set peak of one fresh-process run at this "
        "config's batch, run after the trial and kept as a measured peak (TrialBudget.record_peak); None where none "
        "ran (bytes).")
    compile_s: float | None = Field(
        default=None, description="Warm-up time beyond ordinary steps, spent compiling (s).")
    compiled_graphs: int | None = Field(
        default=None, description="Graphs torch.compile captured and compiled (compiled runs).")
    warmup_s: float | None = Field(default=None, description="Warm-up steps' wall time (s).")
    measured_s: float | None = Field(default=None, description="The timed window (s).")
    measured_steps: int | None = None
    mfu: float | None = Field(
        default=None, description="Traced FLOPs/s over the hardware's dense peak for the precision.")
    bottleneck: Bottleneck | None = None
    environment: Environment | None = None
    wall_s: float = Field(default=0.0, description="The whole trial as the caller saw it (s).")
    overhead_s: float | None = Field(default=None, description="wall_s less warm-up and timed window (s).")
    build_s: float | None = Field(
        default=None,
        description="Part of overhead_s: building, wrapping and compiling-wrapping the model, and the optimizer (s).")
    notes: list[str] = Field(default_factory=list)
    rank_digests: list[str] = Field(
        default_factory=list, description="Per rank: a hash of the parameters after the last step (data-parallel "
        "trials: ranks must agree; none for tp/pp ranks, which hold different shards and stages).")
    ranks: list[RankFigures] | None = Field(
        default=None, description="Tensor- or pipeline-parallel trials: every rank's figures, in rank order.")

    @property
    def ok(self) -> bool:
        return self.status == TrialStatus.ok

"""Typed inputs and outputs of the estimator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError, model_validator

from advisor.config import CHECKPOINTING_DOC, Checkpointing, OptimizerKind, Precision, Strategy
from advisor.errors import SpecError, invalid_input

if TYPE_CHECKING:
    from advisor.estimate.evaluator import Evaluator
    from advisor.estimate.resident.calibration import Run
    from advisor.hardware.spec import HardwareSpec
    from advisor.workload import Workload


class EstimateRequest(BaseModel):
    """One configuration to estimate; the workload and hardware travel beside it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch_size: int | None = Field(default=None, gt=0, description="Micro-batch per device (samples); None: the "
                                   "workload's default_batch_size (an estimate's request always names it).")
    precision: Precision = Precision.fp32
    optimizer: OptimizerKind = OptimizerKind.adamw
    strategy: Strategy = Strategy.single
    checkpointing: Checkpointing = Field(default=Checkpointing.none, description=CHECKPOINTING_DOC)
    fused_backward: bool = Field(default=False,
                                 description="Optimizer step in each parameter's post-accumulate-grad hook.")
    offload_optimizer: bool = Field(default=False, description="Optimizer state and step on the host (ZeRO-Offload).")
    offload_params: bool = Field(default=False, description="Sharded parameters on the host (ZeRO-3 only).")
    optimizer_impl: Literal["for-loop", "foreach", "fused"] | None = None

    @model_validator(mode="after")
    def _check(self) -> "EstimateRequest":
        if self.offload_params and self.strategy != Strategy.zero3:
            raise ValueError("offload_params needs strategy zero3 (parameters must be sharded to live on the host)")
        if self.fused_backward and self.strategy.sharded:
            raise ValueError("fused_backward applies to single and ddp strategies, not ZeRO/FSDP")
        return self

    @classmethod
    def of(cls, batch_size: int | None = None, **knobs: Any) -> EstimateRequest:
        """The request for `batch_size` and `knobs` (these fields, as enums or their values), or a one-line
        SpecError saying what is wrong: what the CLI (exit 2) and the API (422) build from their input."""
        if batch_size is not None and batch_size <= 0:
            raise SpecError(f"batch size must be a positive integer, got {batch_size}")
        try:
            return cls(batch_size=batch_size, **knobs)
        except ValidationError as exc:
            raise invalid_input(exc) from exc


def _peaks_store(value: Any) -> Any:
    from advisor.peaks import MeasuredPeaks  # it imports this module

    if isinstance(value, (bool, MeasuredPeaks)):
        return value
    raise ValueError(f"measured takes True, False or a MeasuredPeaks store, not {type(value).__name__}")


class EstimateOptions(BaseModel):
    """How to estimate, beside what: the method, the real runs allowed, the margin, the measured peaks used."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["auto", "traced", "analytic"] = Field(
        default="auto", description="'traced' (fake-tensor trace), 'analytic' (decoder formulas), or 'auto' (analytic "
        "for decoders above settings.trace_param_limit parameters, else traced).")
    calibrate: bool | Literal["kept"] | None = Field(
        default=None, description="Allow short real runs at small batches when the target is this machine's CPU, "
        "and each cuDNN convolution and LSTM layer shape and each reduction run once on this machine's GPU when "
        "that is the target (None: settings.calibrate). 'kept': no real run, but a CPU calibration of the same "
        "request kept on this host (by an earlier `advisor estimate`) is used, the notes say which, and an untraceable "
        "model is an EstimateError rather than real steps (the API's).")
    margin: float | None = Field(default=None, description="Fraction of device memory kept free "
                                 "(None: settings.memory_margin).")
    measured: Annotated[Any, PlainValidator(_peaks_store)] = Field(
        default=True, description="Refine with measured peaks of the same workload fingerprint, device, knobs and "
        "compile_mode: from the default store (True), this MeasuredPeaks store, or none (False).")
    compile_mode: str = Field(default="none", description="torch.compile mode the step runs under (keys the "
                              "measured peaks).")
    exact_largest: bool = Field(
        default=True, description="Where kernels' scratch is not affine in the batch, search the largest batch again "
        "on exact traces (up to largest.EXACT_TRACES more). False: the largest batch is the traces' line's, said in "
        "a note (the tuner's pruning, naming it where a configuration's batch does not fit).")
    largest: bool = Field(
        default=True, description="Answer the largest batch that fits (max_batch_size, max_batch_by_strategy). "
        "False: the request's own batch only, from one trace where the step traces (the batch model's second "
        "trace is what the largest batch is solved on); max_batch_size is then None. For callers that decide "
        "one configuration: the tuner's pruning asks again with it where the batch does not fit.")
    line: bool = Field(
        default=False, description="With largest=False and no calibration: a preset's batch is read off the line "
        "through two traces of the same step at other batches kept in this process, where their allocations align "
        "and no kernel's scratch in them departs from it (the line the largest batch is solved on); traced where "
        "there is none, or where the line's batch does not fit: the tuner's pruning, which asks batch after batch "
        "of one step.")


class Breakdown(BaseModel):
    """Bytes per device at the predicted peak; the six parts sum to total_bytes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    parameters: int = Field(description="Parameters and buffers (bytes), plus gathered FSDP units.")
    gradients: int = Field(description="Gradients alive at the peak, plus DDP buckets (bytes).")
    optimizer_state: int = Field(description="Optimizer state (bytes).")
    activations: int = Field(description="Tensors saved by forward for backward, and the input batch (bytes).")
    temporaries: int = Field(description="Other live tensors at the peak: backward and step intermediates (bytes).")
    overhead: int = Field(description="What tensors do not account for: allocator rounding and holes, runtime (bytes).")


class MemoryEstimate(BaseModel):
    """The estimator's answer for one workload, hardware and configuration."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workload: str
    hardware: str
    request: EstimateRequest
    world_size: int
    predicts: Literal["cuda_allocated", "cuda_reserved", "cpu_rss"] = Field(
        description="Which measured quantity of docs/design.md total_bytes predicts; allocated_bytes predicts the "
        "live-tensor peak.")
    total_bytes: int = Field(description="Predicted peak per device of the quantity named by `predicts` (bytes).")
    allocated_bytes: int = Field(description="Predicted peak of live tensor bytes per device (bytes).")
    breakdown: Breakdown
    runtime_bytes: int = Field(default=0,
                               description="CUDA context and library workspaces, and over several GPUs NCCL's "
                               "buffers (nccl.py), outside the allocator (bytes).")
    device_memory_bytes: int = Field(description="Memory of one device (bytes).")
    usable_bytes: int = Field(description="Device memory less the safety margin (bytes).")
    fits: bool
    max_batch_size: int | None = Field(description="Largest micro-batch that fits with this configuration (samples); "
                                       "0 if none; None where the options did not ask for it (largest=False).")
    max_batch_by_strategy: dict[str, int] = Field(default_factory=dict,
                                                  description="Largest batch per strategy (samples).")
    method: Literal["traced", "analytic", "measured"] = Field(description="How allocated_bytes was obtained.")
    calibrated: bool = Field(default=False, description="A short real run on this CPU refined the overhead.")
    refined_by: int = Field(default=0, ge=0, description="Measured peaks of this workload, device and configuration "
                            "that refined total_bytes, fits and the largest batch (count; 0: the estimator alone).")
    num_params: int
    flops_per_step: int = Field(description="Forward+backward FLOPs of one micro-batch step.")
    predicted_step_s: float | None = Field(default=None, description="Roofline time of one step (s).")
    predicted_samples_per_s: float | None = None
    notes: list[str] = Field(default_factory=list)
    seconds: float = Field(description="Wall time the estimate took (s).")


@dataclass(frozen=True)
class Case:
    """One estimate's inputs, resolved: what the estimator's stages share."""

    workload: Workload | str  # as given: a name or file.py:build runs in a fresh process, an object cannot
    workload_args: dict[str, Any] | None
    wl: Workload
    hw: HardwareSpec
    req: EstimateRequest  # its batch_size named
    options: EstimateOptions
    fingerprint: Callable[[], str]  # the workload's; it builds the model on meta, so cached


@dataclass(frozen=True)
class Fitted:
    """The evaluator at the request and what fitted it: measured peaks `points`, a calibration's real runs
    (`calibrated`), and `record`, which keeps later real runs as measured peaks."""

    ev: Evaluator
    points: list[Run]
    calibrated: bool = False
    record: Callable[[tuple[Run, ...]], None] | None = None

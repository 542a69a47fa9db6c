"""Typed inputs and outputs of the estimator."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from advisor.config import OptimizerKind, Precision, Strategy


class EstimateRequest(BaseModel):
    """One configuration to estimate; the workload and hardware travel beside it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch_size: int = Field(gt=0, description="Micro-batch per device (samples).")
    precision: Precision = Precision.fp32
    optimizer: OptimizerKind = OptimizerKind.adamw
    strategy: Strategy = Strategy.single
    checkpointing: bool = Field(default=False, description="Recompute the repeated blocks' activations in backward.")
    fused_backward: bool = Field(default=False, description="Optimizer step in each parameter's post-accumulate-grad hook.")
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
        description="Which measured quantity of DESIGN.md total_bytes predicts; allocated_bytes predicts the live-tensor peak.")
    total_bytes: int = Field(description="Predicted peak per device of the quantity named by `predicts` (bytes).")
    allocated_bytes: int = Field(description="Predicted peak of live tensor bytes per device (bytes).")
    breakdown: Breakdown
    runtime_bytes: int = Field(default=0, description="CUDA context and library workspaces, outside the allocator (bytes).")
    device_memory_bytes: int = Field(description="Memory of one device (bytes).")
    usable_bytes: int = Field(description="Device memory less the safety margin (bytes).")
    fits: bool
    max_batch_size: int = Field(description="Largest micro-batch that fits with this configuration (samples); 0 if none.")
    max_batch_by_strategy: dict[str, int] = Field(default_factory=dict, description="Largest batch per strategy (samples).")
    method: Literal["traced", "analytic", "measured"] = Field(description="How allocated_bytes was obtained.")
    calibrated: bool = Field(default=False, description="A short real run on this CPU refined the overhead.")
    refined_by: int = Field(default=0, ge=0, description="Measured peaks of this workload, device and configuration that "
                            "refined total_bytes, fits and the largest batch (count; 0: the estimator alone).")
    num_params: int
    flops_per_step: int = Field(description="Forward+backward FLOPs of one micro-batch step.")
    predicted_step_s: float | None = Field(default=None, description="Roofline time of one step (s).")
    predicted_samples_per_s: float | None = None
    notes: list[str] = Field(default_factory=list)
    seconds: float = Field(description="Wall time the estimate took (s).")

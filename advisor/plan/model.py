"""What the planner is asked (PlanRequest) and what it answers (Plan, PlanResult)."""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from advisor.finetune import FineTune
from advisor.plan.knobs import FixedKnobs, PlanConfig
from advisor.plan.steptime import StepBreakdown
from advisor.workload import DecoderArch

# The default global batch: about a million tokens per step (2**20), as samples, rounded down to a power of 2 so
# that power-of-2 meshes split it; Llama 3 and NeMo's recipes train at 1-4M tokens per step.
DEFAULT_TOKENS_PER_STEP = 2**20
MAX_NODES = 4096


class Objective(str, Enum):
    """What ranks the plans, and in which direction."""

    tokens_per_s_per_device = "tokens_per_s_per_device"  # higher first
    cost_per_million_tokens = "cost_per_million_tokens"  # lower first

    @property
    def maximize(self) -> bool:
        return self == Objective.tokens_per_s_per_device


class PlanRequest(BaseModel):
    """Plan the training of a decoder on one or more hardware targets."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workload: str | None = Field(default=None, description="Preset name (llama-70b) or file.py:build of a decoder; "
                                 "or give `arch`.")
    workload_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of its build (a "
                                          "fine-tune among them, as advisor.finetune.with_finetune puts it, is "
                                          "taken as `finetune`).")
    arch: DecoderArch | None = Field(default=None, description="The decoder's shape, instead of a workload.")
    finetune: FineTune | None = Field(default=None, description="What of the decoder trains: frozen modules and "
                                      "LoRA adapters (advisor/finetune.py); planned data parallel only. None: "
                                      "full training, or the fine-tune workload_args carry.")
    hardware: list[str] = Field(min_length=1, description="Hardware specs (catalog NAME:N or NAME:NxM); with "
                                "`nodes`, NAME:N gives the devices per node.")
    nodes: tuple[int, int] | None = Field(default=None, description="Plan each node count first..last (inclusive) "
                                          "and rank them together.")
    global_batch_size: int | None = Field(default=None, ge=1, description="Samples per optimizer step; None: "
                                          "DEFAULT_TOKENS_PER_STEP tokens' worth, a power of 2.")
    fixed: FixedKnobs = Field(default_factory=FixedKnobs, description="Knobs held at one value.")
    prices: dict[str, float] = Field(default_factory=dict, description="USD per device-hour by catalog name; "
                                     "with them, plans rank by cost per million tokens.")
    objective: Objective | None = Field(default=None, description="None: cost where every target is priced, "
                                        "else tokens/s per device.")
    top: int = Field(default=5, ge=1, description="Plans to return.")
    margin: float | None = Field(default=None, ge=0, lt=1, description="Fraction of device memory kept free "
                                 "(None: settings.memory_margin).")

    @model_validator(mode="after")
    def _check(self) -> "PlanRequest":
        if (self.workload is None) == (self.arch is None):
            raise ValueError("give a workload or an arch, not both or neither")
        if self.nodes is not None and not 1 <= self.nodes[0] <= self.nodes[1] <= MAX_NODES:
            raise ValueError(f"nodes {self.nodes[0]}-{self.nodes[1]} has no node count; give FIRST-LAST with "
                             f"1 <= FIRST <= LAST <= {MAX_NODES}, e.g. 1-16")
        if any(not 0 <= p < float("inf") for p in self.prices.values()):
            raise ValueError("prices must be finite numbers >= 0 (USD per device-hour)")
        return self


class Plan(BaseModel):
    """One configuration on one hardware target, its memory and its predicted step."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hardware: str = Field(description="The target, NAME:NxM (N devices per node, M nodes).")
    devices: int
    config: PlanConfig
    memory_per_device_bytes: int = Field(description="Peak device memory of the fullest rank: reserved by the "
                                         "allocator, the CUDA context and NCCL's buffers (bytes).")
    memory: dict[str, int] = Field(description="That peak by part: parameters, gradients, optimizer_state, "
                                   "activations, temporaries, overhead (allocator), runtime (CUDA context), nccl "
                                   "(NCCL's buffers) (bytes).")
    usable_bytes: int = Field(description="Device memory a plan may take, the margin kept free (bytes).")
    fits: bool
    step_time_s: float = Field(description="Seconds per optimizer step.")
    tokens_per_s_per_device: float
    samples_per_s: float = Field(description="Samples per second, all devices.")
    mfu: float | None = Field(description="Model FLOPs utilisation: model FLOPs per device per second over the "
                              "device's dense peak at this precision.")
    breakdown: StepBreakdown
    cost_per_million_tokens: float | None = Field(default=None, description="USD per million tokens trained, "
                                                  "where the target is priced.")


class PlanResult(BaseModel):
    """The planner's answer: the best plans first, or, when none fits, the closest and what would fit."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workload: str
    global_batch_size: int = Field(description="Samples per optimizer step.")
    tokens_per_step: int
    objective: Objective
    plans: list[Plan] = Field(description="Fitting plans, best first; where none fits, the ones needing the least "
                              "memory (fits false).")
    fits: bool = Field(description="Some plan fits.")
    what_would_fit: list[str] = Field(default_factory=list, description="Where none fits: the changes that "
                                      "would make one fit, each computed.")
    notes: list[str] = Field(default_factory=list)
    considered: int = Field(description="Configurations whose memory was computed.")
    timed: int = Field(description="Fitting configurations whose step was predicted.")
    seconds: float

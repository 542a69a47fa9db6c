"""The knobs of one training plan (PlanConfig) and the ones a user holds fixed (FixedKnobs, `--fix KEY=VALUE`)."""

from __future__ import annotations

import json
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from advisor.config import Checkpointing, OptimizerKind, Precision, Strategy
from advisor.errors import SpecError, invalid_input
from advisor.parallel.layout import Layout, PipelineSchedule


class Offload(str, Enum):
    none = "none"
    optimizer = "optimizer"  # ZeRO-Offload: the optimizer state and step on the host


class PlanConfig(BaseModel):
    """One way to run a training step on a mesh of dp x cp x tp x pp devices. The global batch is
    dp x micro_batch_size x microbatches x grad_accum samples (microbatches > 1 under pp only, grad_accum > 1
    without pp only)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dp: int = Field(ge=1, description="Data-parallel replicas.")
    tp: int = Field(ge=1, description="Tensor-parallel ranks (within a node).")
    pp: int = Field(ge=1, description="Pipeline ranks.")
    cp: int = Field(ge=1, description="Context-parallel ranks (ring attention).")
    dp_replicate: int = Field(default=1, ge=1, description="HSDP groups (1: plain data parallel or ZeRO).")
    strategy: Strategy
    schedule: PipelineSchedule | None = Field(default=None, description="Pipeline schedule; None without pp.")
    virtual_stages: int = Field(default=1, ge=1, description="Stages per pipeline rank (interleaved 1F1B).")
    microbatches: int = Field(default=1, ge=1, description="Micro-batches per step through the pipeline (1 "
                              "without pp).")
    micro_batch_size: int = Field(ge=1, description="Samples per micro-batch per data-parallel replica.")
    grad_accum: int = Field(default=1, ge=1, description="Micro-batches accumulated per optimizer step (no pp).")
    checkpointing: Checkpointing
    precision: Precision
    optimizer: OptimizerKind
    offload: Offload = Offload.none
    sequence_parallel: bool = Field(default=False, description="Norms and residuals split along the sequence "
                                    "over the tp ranks.")

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step."""
        return self.dp * self.micro_batch_size * self.microbatches * self.grad_accum

    def layout(self) -> Layout:
        return Layout(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, dp_replicate=self.dp_replicate,
                      strategy=self.strategy, schedule=self.schedule or PipelineSchedule.one_f_one_b,
                      microbatches=self.microbatches if self.pp > 1 else None, virtual_stages=self.virtual_stages,
                      sequence_parallel=self.sequence_parallel)

    def label(self) -> str:
        """The mesh in a few words: dp8 zero3 tp4 pp2 1f1b x16 mb."""
        return self.layout().label()


class FixedKnobs(BaseModel):
    """Knobs held at one value (None: searched, or the default for precision and optimizer)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dp: int | None = Field(default=None, ge=1)
    tp: int | None = Field(default=None, ge=1)
    pp: int | None = Field(default=None, ge=1)
    cp: int | None = Field(default=None, ge=1)
    dp_replicate: int | None = Field(default=None, ge=1)
    strategy: Strategy | None = None
    schedule: PipelineSchedule | None = None
    virtual_stages: int | None = Field(default=None, ge=1)
    microbatches: int | None = Field(default=None, ge=1)
    micro_batch_size: int | None = Field(default=None, ge=1)
    grad_accum: int | None = Field(default=None, ge=1)
    checkpointing: Checkpointing | None = None
    precision: Precision | None = None
    optimizer: OptimizerKind | None = None
    offload: Offload | None = None
    sequence_parallel: bool | None = None

    def given(self) -> dict[str, object]:
        """The knobs held, by name, as the user would write them."""
        return {k: (v.value if isinstance(v, Enum) else v) for k, v in self.model_dump().items() if v is not None}

    def admits(self, config: PlanConfig) -> bool:
        return all(getattr(config, k) == getattr(self, k) for k in type(self).model_fields
                   if getattr(self, k) is not None)

    def without(self, knob: str) -> "FixedKnobs":
        return self.model_copy(update={knob: None})


FIX_KEYS = tuple(FixedKnobs.model_fields)


def parse_fixes(pairs: list[str], flag: str = "--fix") -> FixedKnobs:
    """['tp=4', 'checkpointing=full', ...] -> FixedKnobs; a one-line SpecError for an unknown knob or value."""
    raw: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key or not value.strip():
            raise SpecError(f"{flag} {pair!r} is not KNOB=VALUE; knobs: {', '.join(FIX_KEYS)}")
        if key not in FIX_KEYS:
            raise SpecError(f"{flag} {key}: unknown knob; knobs: {', '.join(FIX_KEYS)}")
        try:
            raw[key] = json.loads(value)
        except json.JSONDecodeError:
            raw[key] = value.strip()
    try:
        return FixedKnobs.model_validate(raw)
    except ValidationError as exc:
        raise invalid_input(exc, {k: f"{flag} {k}" for k in FIX_KEYS}) from exc

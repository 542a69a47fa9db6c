"""Typed values that cross the store's boundary: what a study is, a claim, a stored trial, a query."""

from __future__ import annotations

from datetime import datetime
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from advisor.trial import TrainingConfig, TrialResult, TrialStatus


class RecordStatus(str, Enum):
    """A stored trial's status: the runner's statuses plus what only the tuner knows."""

    ok = "ok"
    oom = "oom"
    timeout = "timeout"
    crashed = "crashed"
    error = "error"
    invalid = "invalid"
    pruned = "pruned"  # not launched: the estimate exceeded device memory
    interrupted = "interrupted"  # was running when its process died; retried once
    running = "running"  # claimed, being measured


TRIAL_STATUSES = tuple(s.value for s in RecordStatus)
STUDY_STATUSES = ("running", "finished", "failed")
# A tune job of the service: queued -> running -> finished | failed; a cancel passes through cancelling.
JOB_STATUSES = ("queued", "running", "cancelling", "cancelled", "finished", "failed")
JOB_DONE = ("cancelled", "finished", "failed")
# Outcomes that a rerun would reproduce, so a later study may reuse them instead of measuring again.
MEASURED = (RecordStatus.ok, RecordStatus.oom)
MAX_ATTEMPTS = 2  # the first run and one retry after an interruption
# Columns a query can sort by (a `-` prefix sorts descending); the first eight are measured figures.
METRICS = ("samples_per_s", "tokens_per_s", "step_p50_s", "step_p90_s", "peak_memory_bytes",
           "predicted_memory_bytes", "data_wait_fraction", "mfu")
SORTABLE = METRICS + ("id", "attempt", "started_at", "finished_at")

assert {s.value for s in TrialStatus} <= set(TRIAL_STATUSES)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ObjectiveMetric(_Frozen):
    name: Literal[METRICS]  # type: ignore[valid-type]
    direction: Literal["maximize", "minimize"]


class Objective(_Frozen):
    """What a study optimizes, passed through to Optuna as is. The first metric ranks `best`."""

    metrics: tuple[ObjectiveMetric, ...] = Field(min_length=1)

    @property
    def key(self) -> str:
        """e.g. 'samples_per_s:maximize' or 'samples_per_s:maximize,peak_memory_bytes:minimize'."""
        return ",".join(f"{m.name}:{m.direction}" for m in self.metrics)

    @classmethod
    def parse(cls, key: str) -> "Objective":
        metrics = [dict(zip(("name", "direction"), part.split(":", 1))) for part in key.split(",")]
        return cls(metrics=metrics)


class StudySpec(_Frozen):
    """What `create_or_get_study` needs. Fingerprints are computed by the caller (workload) or by
    `hardware_fingerprint`; a study's name is unique across the store."""

    name: str = Field(min_length=1, max_length=200)
    workload_fp: str = Field(min_length=1, max_length=64)
    workload_name: str
    workload_description: dict[str, Any] = Field(default_factory=dict)
    hardware_fp: str = Field(min_length=1, max_length=64)
    hardware_name: str
    hardware_spec: dict[str, Any] = Field(description="HardwareSpec.model_dump(mode='json').")
    space: dict[str, Any] = Field(default_factory=dict, description="The search space, as JSON.")
    objective: Objective
    software: dict[str, str | None] = Field(description="software_versions() of the process that created it.")
    optuna_study_name: str | None = Field(default=None, description="Default: the study's name.")


class StudyRecord(_Frozen):
    id: int
    name: str
    workload_fp: str
    hardware_fp: str
    workload_name: str | None = None
    hardware_name: str | None = None
    space: dict[str, Any]
    objective: Objective
    software: dict[str, str | None]
    software_fp: str
    optuna_study_name: str
    status: Literal["running", "finished", "failed"]
    created_at: datetime
    finished_at: datetime | None = None


class Claim(_Frozen):
    """A configuration reserved for measuring by one process: the row exists, status `running`."""

    trial_id: int
    study_id: int
    config: TrainingConfig
    config_hash: str
    attempt: int = Field(ge=1)
    owner: str = Field(description="host:pid of the claiming process.")


class TrialRecord(_Frozen):
    """One stored trial with its study's keys; figures are the TrialResult's (units there)."""

    id: int
    study_id: int
    study_name: str
    workload_fp: str
    workload_name: str
    hardware_fp: str
    hardware_name: str
    config: TrainingConfig
    config_hash: str
    attempt: int
    status: RecordStatus
    owner: str
    software_fp: str
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    step_p50_s: float | None = None
    step_p90_s: float | None = None
    peak_memory_bytes: int | None = None
    predicted_memory_bytes: int | None = None
    data_wait_fraction: float | None = None
    mfu: float | None = None
    bottleneck: str | None = None
    result: TrialResult | None = None
    error: str | None = None
    estimate: dict[str, Any] | None = None
    started_at: datetime
    finished_at: datetime | None = None


class BestRecord(_Frozen):
    workload_fp: str
    hardware_fp: str
    objective: str = Field(description="Objective.key")
    trial: TrialRecord
    updated_at: datetime


class JobRecord(_Frozen):
    """A tune job queued through the service; `request` is the API's TuneJobRequest as JSON."""

    id: str
    status: Literal[JOB_STATUSES]  # type: ignore[valid-type]
    request: dict[str, Any]
    devices: int = Field(ge=1, description="Devices (or the CPU) the job occupies while it runs.")
    study_id: int | None = None
    study_name: str | None = None
    owner: str | None = Field(default=None, description="host:pid of the worker running it.")
    attempts: int = Field(ge=0, description="Times a worker started it (a resume after a restart counts).")
    error: str | None = None
    cancel_requested: bool = False
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    heartbeat_at: datetime | None = None


class TrialQuery(_Frozen):
    """Filters for `query_trials`. workload/hardware match a name, a fingerprint or a fingerprint
    prefix of 8+ characters; study matches a name or an id."""

    workload: str | None = None
    hardware: str | None = None
    study: str | int | None = None
    status: tuple[RecordStatus, ...] = ()
    trial_id: int | None = None
    config_hash: str | None = None
    software_fp: str | None = None
    sort: str = Field(default="id", description=f"One of {', '.join(SORTABLE)}; a '-' prefix sorts descending.")
    limit: int | None = Field(default=None, gt=0)
    offset: int = Field(default=0, ge=0)

    @field_validator("sort")
    @classmethod
    def _sort_known(cls, v: str) -> str:
        if v.lstrip("-") not in SORTABLE:
            raise ValueError(f"cannot sort by {v!r}; choose from {', '.join(SORTABLE)} (prefix '-' for descending)")
        return v

    @model_validator(mode="before")
    @classmethod
    def _status_tuple(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("status"), (str, RecordStatus)):
            data = {**data, "status": (data["status"],)}
        return data

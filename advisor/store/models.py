"""SQLAlchemy 2 ORM models of the result store. Tables carry an `advisor_` prefix because Optuna's
RDB storage lives in the same database with its own `studies`, `trials` and `alembic_version`."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from advisor.store.records import JOB_STATUSES, STUDY_STATUSES, TRIAL_STATUSES

# Named constraints, so migrations can address them on every backend (SQLite batch mode included).
NAMING = {"ix": "ix_%(column_0_label)s", "uq": "uq_%(table_name)s_%(column_0_name)s",
          "ck": "ck_%(table_name)s_%(constraint_name)s",
          "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
          "pk": "pk_%(table_name)s"}
FP = String(64)  # a sha256 hex digest (or a caller's fingerprint of at most 64 characters)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dict[str, Any]: JSON, datetime: DateTime(timezone=True)}


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class HardwareRow(Base):
    __tablename__ = "advisor_hardware"

    fingerprint: Mapped[str] = mapped_column(FP, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    spec: Mapped[dict[str, Any]]  # HardwareSpec.model_dump(mode="json")
    created_at: Mapped[datetime]


class WorkloadRow(Base):
    __tablename__ = "advisor_workloads"

    fingerprint: Mapped[str] = mapped_column(FP, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    description: Mapped[dict[str, Any]]  # what the fingerprint was computed from, for people
    created_at: Mapped[datetime]


class StudyRow(Base):
    __tablename__ = "advisor_studies"
    __table_args__ = (CheckConstraint(_in("status", STUDY_STATUSES), name="status"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    workload_fp: Mapped[str] = mapped_column(FP, ForeignKey("advisor_workloads.fingerprint"), index=True)
    hardware_fp: Mapped[str] = mapped_column(FP, ForeignKey("advisor_hardware.fingerprint"), index=True)
    space: Mapped[dict[str, Any]]
    objective: Mapped[dict[str, Any]]  # Objective.model_dump(mode="json"): metric names and directions
    software: Mapped[dict[str, Any]]  # software_versions()
    software_fp: Mapped[str] = mapped_column(FP)
    optuna_study_name: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]


class TrialRow(Base):
    __tablename__ = "advisor_trials"
    __table_args__ = (
        # The claim: the loser of two concurrent INSERTs of one (study, config, attempt) gets an IntegrityError.
        UniqueConstraint("study_id", "config_hash", "attempt", name="uq_advisor_trials_claim"),
        CheckConstraint(_in("status", TRIAL_STATUSES), name="status"),
        CheckConstraint("attempt >= 1", name="attempt"),
        Index("ix_advisor_trials_reuse", "config_hash", "software_fp"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("advisor_studies.id", ondelete="CASCADE"), index=True)
    config: Mapped[dict[str, Any]]  # TrainingConfig.model_dump(mode="json")
    config_hash: Mapped[str] = mapped_column(FP)
    attempt: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), index=True)
    owner: Mapped[str] = mapped_column(String(200))  # "host:pid" of the process that claimed it
    software_fp: Mapped[str] = mapped_column(FP)
    samples_per_s: Mapped[float | None] = mapped_column(Float)
    tokens_per_s: Mapped[float | None] = mapped_column(Float)
    step_p50_s: Mapped[float | None] = mapped_column(Float)
    step_p90_s: Mapped[float | None] = mapped_column(Float)
    peak_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    predicted_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    data_wait_fraction: Mapped[float | None] = mapped_column(Float)
    mfu: Mapped[float | None] = mapped_column(Float)
    bottleneck: Mapped[str | None] = mapped_column(String(32))
    result: Mapped[dict[str, Any] | None]  # TrialResult.model_dump(mode="json")
    error: Mapped[str | None] = mapped_column(Text)
    estimate: Mapped[dict[str, Any] | None]  # the estimator's MemoryEstimate (JSON), where one was made
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]


class BestRow(Base):
    __tablename__ = "advisor_best"

    workload_fp: Mapped[str] = mapped_column(FP, ForeignKey("advisor_workloads.fingerprint"), primary_key=True)
    hardware_fp: Mapped[str] = mapped_column(FP, ForeignKey("advisor_hardware.fingerprint"), primary_key=True)
    objective: Mapped[str] = mapped_column(String(200), primary_key=True)  # Objective.key
    trial_id: Mapped[int] = mapped_column(ForeignKey("advisor_trials.id", ondelete="CASCADE"))
    updated_at: Mapped[datetime]


class JobRow(Base):
    """A tune job of the service (`POST /v1/tune`); workers claim queued rows by a conditional UPDATE."""

    __tablename__ = "advisor_jobs"
    __table_args__ = (CheckConstraint(_in("status", JOB_STATUSES), name="status"),
                      CheckConstraint("devices >= 1", name="devices"))

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # uuid4 hex
    status: Mapped[str] = mapped_column(String(16), index=True)
    request: Mapped[dict[str, Any]]
    devices: Mapped[int] = mapped_column(Integer)
    study_id: Mapped[int | None] = mapped_column(ForeignKey("advisor_studies.id", ondelete="SET NULL"))
    study_name: Mapped[str | None] = mapped_column(String(200))
    owner: Mapped[str | None] = mapped_column(String(200))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    heartbeat_at: Mapped[datetime | None]

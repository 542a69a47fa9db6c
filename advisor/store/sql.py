"""The SQLAlchemy implementation of ResultStore, for SQLite and PostgreSQL alike. Claims rest on the
unique (study_id, config_hash, attempt) constraint: of two concurrent INSERTs one fails, on both."""

from __future__ import annotations

import functools
import os
import socket
from datetime import datetime, timezone
from typing import Any, Callable, TypeVar

from sqlalchemy import and_, func, insert, or_, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from advisor.errors import StoreError
from advisor.store.base import ResultStore
from advisor.store.engine import describe, guarded, make_engine, resolve_url
from advisor.store.fingerprints import config_hash, software_fingerprint
from advisor.store.migrate import ensure_schema
from advisor.store.models import BestRow, HardwareRow, StudyRow, TrialRow, WorkloadRow
from advisor.store.records import (
    MAX_ATTEMPTS,
    BestRecord,
    Claim,
    Objective,
    RecordStatus,
    StudyRecord,
    StudySpec,
    TrialQuery,
    TrialRecord,
)
from advisor.trial import TrainingConfig

F = TypeVar("F", bound=Callable[..., Any])
_TRIAL_VIEW = (TrialRow, StudyRow.name, StudyRow.workload_fp, StudyRow.hardware_fp, WorkloadRow.name, HardwareRow.name)


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _utc(dt: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; every stored time is UTC."""
    return dt.replace(tzinfo=timezone.utc) if dt is not None and dt.tzinfo is None else dt


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def owner_gone(owner: str) -> bool:
    """Whether the claiming process has ended: known only for processes of this host."""
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _db(method: F) -> F:
    """Database failures inside a store method become one-line StoreErrors."""

    @functools.wraps(method)
    def wrapper(self: "SqlResultStore", *args: Any, **kwargs: Any) -> Any:
        with guarded(self.url):
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _key_match(fp_col, name_col, value: str):  # noqa: ANN001, ANN202 (SQL expressions)
    """A name, a fingerprint, or a fingerprint prefix of 8+ characters."""
    terms = [name_col == value, fp_col == value]
    if len(value) >= 8:
        terms.append(fp_col.startswith(value, autoescape=True))
    return or_(*terms)


def _study_match(value: str | int):  # noqa: ANN202
    if isinstance(value, int):
        return StudyRow.id == value
    return or_(StudyRow.name == value, StudyRow.id == int(value)) if value.isdigit() else StudyRow.name == value


class SqlResultStore(ResultStore):
    """ResultStore on a SQLAlchemy engine (SQLite or PostgreSQL through psycopg 3)."""

    def __init__(self, engine: Engine, url: str) -> None:
        self.engine = engine
        self.url = url
        self.owner = _owner()

    @classmethod
    def open(cls, url: str | None = None, *, busy_timeout_s: float | None = None) -> "SqlResultStore":
        url = resolve_url(url)
        engine = make_engine(url, busy_timeout_s=busy_timeout_s)
        try:
            with guarded(url):
                ensure_schema(engine, describe(url))
        except BaseException:
            engine.dispose()
            raise
        return cls(engine, url)

    def close(self) -> None:
        self.engine.dispose()

    def _session(self) -> Session:
        return Session(self.engine, expire_on_commit=False)

    # -- studies ---------------------------------------------------------------------------------
    @_db
    def create_or_get_study(self, spec: StudySpec) -> StudyRecord:
        study = self.get_study(spec.name)
        if study is None:
            self._insert_key_rows(spec)
            try:
                with self._session() as s, s.begin():
                    s.add(StudyRow(name=spec.name, workload_fp=spec.workload_fp, hardware_fp=spec.hardware_fp,
                                   space=spec.space, objective=spec.objective.model_dump(mode="json"),
                                   software=spec.software, software_fp=software_fingerprint(spec.software),
                                   optuna_study_name=spec.optuna_study_name or spec.name, status="running",
                                   created_at=_now()))
            except IntegrityError:
                pass  # another process created it between our read and our insert
            study = self.get_study(spec.name)
            assert study is not None
        mismatch = [what for what, ours, theirs in (("workload", study.workload_fp, spec.workload_fp),
                                                    ("hardware", study.hardware_fp, spec.hardware_fp),
                                                    ("objective", study.objective.key, spec.objective.key))
                    if ours != theirs]
        if mismatch:
            raise StoreError(f"study {spec.name!r} exists with another {' and '.join(mismatch)}; "
                             f"choose another study name")
        return study

    def _insert_key_rows(self, spec: StudySpec) -> None:
        rows = ((HardwareRow, {"fingerprint": spec.hardware_fp, "name": spec.hardware_name,
                               "spec": spec.hardware_spec}),
                (WorkloadRow, {"fingerprint": spec.workload_fp, "name": spec.workload_name,
                               "description": spec.workload_description}))
        for model, values in rows:
            try:
                with self._session() as s, s.begin():
                    if s.get(model, values["fingerprint"]) is None:
                        s.add(model(**values, created_at=_now()))
            except IntegrityError:
                pass  # inserted concurrently: the same content, keyed by its fingerprint

    @_db
    def get_study(self, name_or_id: str | int) -> StudyRecord | None:
        found = self._studies(_study_match(name_or_id), limit=1)
        return found[0] if found else None

    @_db
    def list_studies(self, *, limit: int | None = None, offset: int = 0) -> tuple[list[StudyRecord], int]:
        """Newest first, and how many there are in all."""
        with self.engine.connect() as conn:
            total = conn.execute(select(func.count()).select_from(StudyRow)).scalar_one()
        return self._studies(None, limit=limit, offset=offset, newest_first=True), total

    def _studies(self, where: Any, *, limit: int | None, offset: int = 0,
                 newest_first: bool = False) -> list[StudyRecord]:
        stmt = (select(StudyRow, WorkloadRow.name, HardwareRow.name)
                .join(WorkloadRow, StudyRow.workload_fp == WorkloadRow.fingerprint)
                .join(HardwareRow, StudyRow.hardware_fp == HardwareRow.fingerprint)
                .order_by(StudyRow.id.desc() if newest_first else StudyRow.id).offset(offset).limit(limit))
        if where is not None:
            stmt = stmt.where(where)
        with self._session() as s:
            return [StudyRecord(id=row.id, name=row.name, workload_fp=row.workload_fp, hardware_fp=row.hardware_fp,
                                workload_name=wname, hardware_name=hname, space=row.space,
                                objective=Objective.model_validate(row.objective), software=row.software,
                                software_fp=row.software_fp, optuna_study_name=row.optuna_study_name,
                                status=row.status, created_at=_utc(row.created_at), finished_at=_utc(row.finished_at))
                    for row, wname, hname in s.execute(stmt)]

    @_db
    def trial_counts(self, study_ids: list[int]) -> dict[int, dict[str, int]]:
        """Trials by status, per study."""
        out: dict[int, dict[str, int]] = {i: {} for i in study_ids}
        if not study_ids:
            return out
        with self.engine.connect() as conn:
            rows = conn.execute(select(TrialRow.study_id, TrialRow.status, func.count())
                                .where(TrialRow.study_id.in_(study_ids)).group_by(TrialRow.study_id, TrialRow.status))
            for study_id, status, n in rows:
                out[study_id][status] = n
        return out

    @_db
    def finish_study(self, study_id: int, status: str = "finished") -> None:
        with self.engine.begin() as conn:
            conn.execute(update(StudyRow).where(StudyRow.id == study_id).values(status=status, finished_at=_now()))

    # -- trials ----------------------------------------------------------------------------------
    @_db
    def claim_trial(self, study_id: int, config: TrainingConfig, *, repeat: bool = False) -> Claim | None:
        h = config_hash(config)
        with self.engine.connect() as conn:
            last = conn.execute(select(TrialRow.attempt, TrialRow.status)
                                .where(TrialRow.study_id == study_id, TrialRow.config_hash == h)
                                .order_by(TrialRow.attempt.desc()).limit(1)).first()
            software_fp = conn.execute(select(StudyRow.software_fp).where(StudyRow.id == study_id)).scalar_one_or_none()
        if software_fp is None:
            raise StoreError(f"no study with id {study_id} in {describe(self.url)}")
        if last is None:
            attempt = 1
        elif last.status == RecordStatus.interrupted.value and last.attempt < MAX_ATTEMPTS or \
                repeat and last.status == RecordStatus.ok.value:
            attempt = last.attempt + 1
        else:
            return None  # measured, running elsewhere, or out of attempts
        # The INSERT alone decides: a concurrent claim of the same attempt violates the unique key.
        try:
            with self.engine.begin() as conn:
                trial_id = conn.execute(insert(TrialRow).values(
                    study_id=study_id, config=config.model_dump(mode="json"), config_hash=h, attempt=attempt,
                    status=RecordStatus.running.value, owner=self.owner, software_fp=software_fp,
                    started_at=_now()).returning(TrialRow.id)).scalar_one()
        except IntegrityError:
            return None
        return Claim(trial_id=trial_id, study_id=study_id, config=config, config_hash=h, attempt=attempt,
                     owner=self.owner)

    @_db
    def _finish(self, claim: Claim, columns: dict[str, Any], estimate: dict[str, Any] | None) -> TrialRecord:
        values = {**columns, "status": RecordStatus(columns["status"]).value, "finished_at": _now()}
        if estimate is not None:
            values["estimate"] = estimate
        # Only a running row: one marked interrupted (its owner died) may be retried by another
        # process, so a late result from an orphan of the dead owner must not land beside it.
        open_states = (RecordStatus.running.value,)
        with self.engine.begin() as conn:
            done = conn.execute(update(TrialRow).where(TrialRow.id == claim.trial_id, TrialRow.status.in_(open_states))
                                .values(**values)).rowcount
        if done != 1:
            raise StoreError(f"trial {claim.trial_id} is not open (finished already, or never claimed)")
        record = self.get_trial(claim.trial_id)
        assert record is not None
        return record

    @_db
    def mark_interrupted(self, study_id: int, *, all_owners: bool = False) -> int:
        with self.engine.begin() as conn:
            running = conn.execute(select(TrialRow.id, TrialRow.owner).where(
                TrialRow.study_id == study_id, TrialRow.status == RecordStatus.running.value)).all()
            gone = [r.id for r in running if r.owner != self.owner and (all_owners or owner_gone(r.owner))]
            if gone:
                conn.execute(update(TrialRow).where(TrialRow.id.in_(gone),
                                                    TrialRow.status == RecordStatus.running.value)
                             .values(status=RecordStatus.interrupted.value, finished_at=_now(),
                                     error="interrupted: the process measuring it ended before it finished"))
        return len(gone)

    @_db
    def query_trials(self, query: TrialQuery) -> list[TrialRecord]:
        stmt = (select(*_TRIAL_VIEW).join(StudyRow, TrialRow.study_id == StudyRow.id)
                .join(WorkloadRow, StudyRow.workload_fp == WorkloadRow.fingerprint)
                .join(HardwareRow, StudyRow.hardware_fp == HardwareRow.fingerprint))
        stmt = stmt.where(*self._filters(query))
        column = getattr(TrialRow, query.sort.lstrip("-"))
        order = column.desc() if query.sort.startswith("-") else column.asc()
        stmt = stmt.order_by(order.nulls_last(), TrialRow.id).offset(query.offset).limit(query.limit)
        with self._session() as s:
            return [self._trial_record(row) for row in s.execute(stmt)]

    @_db
    def count_trials(self, query: TrialQuery) -> int:
        """How many trials match `query`'s filters (its sort, limit and offset aside)."""
        stmt = (select(func.count()).select_from(TrialRow).join(StudyRow, TrialRow.study_id == StudyRow.id)
                .join(WorkloadRow, StudyRow.workload_fp == WorkloadRow.fingerprint)
                .join(HardwareRow, StudyRow.hardware_fp == HardwareRow.fingerprint).where(*self._filters(query)))
        with self.engine.connect() as conn:
            return conn.execute(stmt).scalar_one()

    @_db
    def trial_status_counts(self) -> dict[str, int]:
        with self.engine.connect() as conn:
            return dict(conn.execute(select(TrialRow.status, func.count()).group_by(TrialRow.status)).all())

    @_db
    def best_generation(self) -> tuple[int, str | None]:
        """Changes whenever a best configuration is stored or replaced: (rows, latest update)."""
        with self.engine.connect() as conn:
            n, latest = conn.execute(select(func.count(), func.max(BestRow.updated_at))).one()
        return n, None if latest is None else str(latest)

    @staticmethod
    def _filters(q: TrialQuery) -> list[Any]:
        where: list[Any] = []
        if q.workload:
            where.append(_key_match(StudyRow.workload_fp, WorkloadRow.name, q.workload))
        if q.hardware:
            where.append(_key_match(StudyRow.hardware_fp, HardwareRow.name, q.hardware))
        if q.study is not None:
            where.append(_study_match(q.study))
        if q.status:
            where.append(TrialRow.status.in_([s.value for s in q.status]))
        for column, value in ((TrialRow.id, q.trial_id), (TrialRow.config_hash, q.config_hash),
                              (TrialRow.software_fp, q.software_fp)):
            if value is not None:
                where.append(column == value)
        return where

    @staticmethod
    def _trial_record(row: Any) -> TrialRecord:
        t: TrialRow = row[0]
        fields = {c.key: getattr(t, c.key) for c in TrialRow.__table__.columns}
        fields.update(study_name=row[1], workload_fp=row[2], hardware_fp=row[3], workload_name=row[4],
                      hardware_name=row[5], started_at=_utc(t.started_at), finished_at=_utc(t.finished_at))
        return TrialRecord.model_validate(fields)

    # -- best configurations ---------------------------------------------------------------------
    @_db
    def update_best(self, workload_fp: str, hardware_fp: str, objective: Objective, trial_id: int) -> bool:
        metric = objective.metrics[0]
        column = getattr(TrialRow, metric.name)
        with self.engine.connect() as conn:
            value = conn.execute(select(column).where(TrialRow.id == trial_id,
                                                      TrialRow.status == RecordStatus.ok.value)).scalar_one_or_none()
        if value is None:
            return False  # only an ok trial with the metric measured can be best
        key = and_(BestRow.workload_fp == workload_fp, BestRow.hardware_fp == hardware_fp,
                   BestRow.objective == objective.key)
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(BestRow).values(workload_fp=workload_fp, hardware_fp=hardware_fp,
                                                    objective=objective.key, trial_id=trial_id, updated_at=_now()))
            return True
        except IntegrityError:
            pass  # a best is stored: replace it only if this one is better, in one statement
        current = select(column).where(TrialRow.id == BestRow.trial_id).scalar_subquery()
        better = current < value if metric.direction == "maximize" else current > value
        with self.engine.begin() as conn:
            conn.execute(update(BestRow).where(key, or_(better, current.is_(None)))
                         .values(trial_id=trial_id, updated_at=_now()))
            return conn.execute(select(BestRow.trial_id).where(key)).scalar_one() == trial_id

    @_db
    def best(self, workload: str | None = None, hardware: str | None = None) -> list[BestRecord]:
        stmt = (select(BestRow).join(WorkloadRow, BestRow.workload_fp == WorkloadRow.fingerprint)
                .join(HardwareRow, BestRow.hardware_fp == HardwareRow.fingerprint)
                .order_by(WorkloadRow.name, HardwareRow.name, BestRow.objective))
        if workload:
            stmt = stmt.where(_key_match(BestRow.workload_fp, WorkloadRow.name, workload))
        if hardware:
            stmt = stmt.where(_key_match(BestRow.hardware_fp, HardwareRow.name, hardware))
        with self._session() as s:
            rows = s.scalars(stmt).all()
        out = []
        for r in rows:
            trial = self.get_trial(r.trial_id)
            assert trial is not None  # the foreign key holds it
            out.append(BestRecord(workload_fp=r.workload_fp, hardware_fp=r.hardware_fp, objective=r.objective,
                                  trial=trial, updated_at=_utc(r.updated_at)))
        return out

    # -- workload and hardware rows --------------------------------------------------------------
    @_db
    def workload_description(self, workload_fp: str) -> dict[str, Any] | None:
        with self._session() as s:
            row = s.get(WorkloadRow, workload_fp)
            return None if row is None else dict(row.description or {})

    @_db
    def hardware_spec(self, hardware_fp: str) -> dict[str, Any] | None:
        with self._session() as s:
            row = s.get(HardwareRow, hardware_fp)
            return None if row is None else dict(row.spec)

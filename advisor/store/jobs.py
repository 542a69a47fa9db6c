"""The service's job queue, in the store's database: submit, claim, cancel, finish, recover.

Workers on any host claim the oldest queued job that fits their free devices by a conditional
UPDATE (`... WHERE id = ? AND status = 'queued'`): of two workers, one changes the row, on SQLite
and PostgreSQL alike. A running job names its worker (host:pid) and the worker refreshes a
heartbeat; a job whose worker is gone (the pid is dead on this host, or the heartbeat is older than
`stale_s` anywhere) goes back to the queue and resumes its study when claimed again.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import func, select, update

from advisor.store.models import JobRow
from advisor.store.records import JOB_DONE, JobRecord
from advisor.store.sql import SqlResultStore, _db, _now, _utc, owner_gone

STALE_S = 60.0  # a running job whose worker's heartbeat is older than this is orphaned (s)


def _record(row: JobRow) -> JobRecord:
    fields = {c.key: getattr(row, c.key) for c in JobRow.__table__.columns}
    for key in ("created_at", "started_at", "finished_at", "heartbeat_at"):
        fields[key] = _utc(fields[key])
    return JobRecord.model_validate(fields)


class JobQueue:
    """Jobs of one store. Every method is one short transaction; nothing is held between calls."""

    def __init__(self, store: SqlResultStore) -> None:
        self.store = store
        self.url = store.url
        self.engine = store.engine

    def _session(self):  # noqa: ANN202
        return self.store._session()

    @_db
    def submit(self, request: dict[str, Any], devices: int) -> JobRecord:
        row = JobRow(id=uuid.uuid4().hex, status="queued", request=request, devices=devices, attempts=0,
                     cancel_requested=False, created_at=_now())
        with self._session() as s, s.begin():
            s.add(row)
        return _record(row)

    @_db
    def get(self, job_id: str) -> JobRecord | None:
        with self._session() as s:
            row = s.get(JobRow, job_id)
            return None if row is None else _record(row)

    @_db
    def list(self, *, status: tuple[str, ...] = (), limit: int = 50, offset: int = 0) -> tuple[list[JobRecord], int]:
        """Newest first, and how many match in all."""
        where = [JobRow.status.in_(status)] if status else []
        with self._session() as s:
            total = s.scalar(select(func.count()).select_from(JobRow).where(*where)) or 0
            rows = s.scalars(select(JobRow).where(*where).order_by(JobRow.created_at.desc(), JobRow.id)
                             .offset(offset).limit(limit)).all()
            return [_record(r) for r in rows], total

    @_db
    def counts(self) -> dict[str, int]:
        with self._session() as s:
            return dict(s.execute(select(JobRow.status, func.count()).group_by(JobRow.status)).all())

    @_db
    def claim_next(self, owner: str, free_devices: int) -> JobRecord | None:
        """The oldest queued job needing at most `free_devices`, now running under `owner`; None if none."""
        with self._session() as s:
            candidates = s.scalars(select(JobRow.id).where(JobRow.status == "queued", JobRow.devices <= free_devices)
                                   .order_by(JobRow.created_at, JobRow.id).limit(8)).all()
        for job_id in candidates:
            now = _now()
            with self.engine.begin() as conn:
                changed = conn.execute(update(JobRow).where(JobRow.id == job_id, JobRow.status == "queued")
                                       .values(status="running", owner=owner, started_at=now, heartbeat_at=now,
                                               attempts=JobRow.attempts + 1, error=None)).rowcount
            if changed:
                return self.get(job_id)
        return None

    @_db
    def heartbeat(self, owner: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(JobRow).where(JobRow.owner == owner, JobRow.status.in_(("running", "cancelling")))
                         .values(heartbeat_at=_now()))

    @_db
    def set_study(self, job_id: str, study_id: int, study_name: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(JobRow).where(JobRow.id == job_id).values(study_id=study_id, study_name=study_name))

    @_db
    def finish(self, job_id: str, status: str, error: str | None = None, *, owner: str | None = None) -> bool:
        """Running (or cancelling) -> a final status, or back to `queued`; False if it was not running
        (or, with `owner`, not this owner's)."""
        assert status in JOB_DONE or status == "queued", status
        where = [JobRow.id == job_id, JobRow.status.in_(("running", "cancelling"))]
        if owner is not None:
            where.append(JobRow.owner == owner)
        values: dict[str, Any] = {"status": status, "error": error}
        if status == "queued":
            values.update(owner=None, heartbeat_at=None)
        else:
            values["finished_at"] = _now()
        with self.engine.begin() as conn:
            return bool(conn.execute(update(JobRow).where(*where).values(**values)).rowcount)

    @_db
    def cancel(self, job_id: str) -> JobRecord | None:
        """Queued -> cancelled at once; running -> cancelling (its worker stops it); done: unchanged."""
        with self.engine.begin() as conn:
            conn.execute(update(JobRow).where(JobRow.id == job_id, JobRow.status == "queued")
                         .values(status="cancelled", cancel_requested=True, finished_at=_now()))
            conn.execute(update(JobRow).where(JobRow.id == job_id, JobRow.status == "running")
                         .values(status="cancelling", cancel_requested=True))
        return self.get(job_id)

    @_db
    def orphans(self, stale_s: float = STALE_S) -> list[JobRecord]:
        """Running or cancelling jobs whose worker is gone."""
        cutoff = datetime.now(timezone.utc) - timedelta(seconds=stale_s)
        with self._session() as s:
            rows = s.scalars(select(JobRow).where(JobRow.status.in_(("running", "cancelling")))).all()
        return [_record(r) for r in rows
                if (r.owner and owner_gone(r.owner)) or (_utc(r.heartbeat_at) or cutoff) < cutoff]

    def recover(self, stale_s: float = STALE_S) -> list[str]:
        """Orphaned running jobs back to the queue (their study resumes); orphaned cancels finish as cancelled."""
        moved = []
        for job in self.orphans(stale_s):
            if job.status == "cancelling":
                self.finish(job.id, "cancelled", owner=job.owner)
            elif self.finish(job.id, "queued", owner=job.owner):
                moved.append(job.id)
        return moved

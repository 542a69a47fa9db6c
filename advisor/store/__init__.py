"""The result store: studies, measured trials and best configurations in SQLite or PostgreSQL.

`open_store(url)` gives a ResultStore; SQLAlchemy loads only when a store is opened."""

from __future__ import annotations

from advisor.store.base import ResultStore
from advisor.store.fingerprints import config_hash, hardware_fingerprint, software_fingerprint, software_versions
from advisor.store.records import (
    BestRecord,
    Claim,
    Objective,
    ObjectiveMetric,
    RecordStatus,
    StudyRecord,
    StudySpec,
    TrialQuery,
    TrialRecord,
)

__all__ = ["BestRecord", "Claim", "Objective", "ObjectiveMetric", "RecordStatus", "ResultStore", "StudyRecord",
           "StudySpec", "TrialQuery", "TrialRecord", "config_hash", "hardware_fingerprint", "open_store",
           "software_fingerprint", "software_versions"]


def open_store(url: str | None = None, *, busy_timeout_s: float | None = None) -> ResultStore:
    """The store at `url` (default: the settings' database_url), its schema created on first use."""
    from advisor.store.sql import SqlResultStore

    return SqlResultStore.open(url, busy_timeout_s=busy_timeout_s)

"""The one settings object shared by the CLI and the API (environment prefix ADVISOR_)."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "advisor"


class Settings(BaseSettings):
    """Process-wide settings; every field can be set as ADVISOR_<NAME>."""

    model_config = SettingsConfigDict(env_prefix="ADVISOR_", extra="ignore", frozen=True)

    data_dir: Path = Field(default_factory=_default_data_dir, description="Where the SQLite store, caches and Ray's temp dir live.")
    log_level: str = Field(default="WARNING", description="Python logging level name.")
    memory_margin: float = Field(default=0.05, ge=0.0, lt=1.0, description="Fraction of device memory kept free when deciding what fits.")
    calibrate: bool = Field(default=True, description="Allow a short real calibration run when the target is the local CPU.")
    database_url: str = Field(default_factory=lambda data: f"sqlite:///{data['data_dir'] / 'advisor.db'}",
                              description="SQLAlchemy URL of the result store (postgresql:// is accepted and means psycopg 3).")
    sqlite_busy_timeout_s: float = Field(default=10.0, gt=0, description="How long SQLite waits for another process's lock (s).")
    trace_param_limit: int = Field(default=3_000_000_000, gt=0, description="Models with more parameters than this use the analytic path (parameters).")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()

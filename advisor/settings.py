"""The one settings object shared by the CLI and the API (environment prefix ADVISOR_)."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "advisor"


class Settings(BaseSettings):
    """Process-wide settings; every field can be set as ADVISOR_<NAME>."""

    model_config = SettingsConfigDict(env_prefix="ADVISOR_", extra="ignore", frozen=True)

    data_dir: Path = Field(default_factory=_default_data_dir,
                           description="Where the SQLite store, caches and Ray's temp dir live.")
    log_level: str = Field(default="WARNING", description="Python logging level name.")
    memory_margin: float = Field(default=0.05, ge=0.0, lt=1.0,
                                 description="Fraction of device memory kept free when deciding what fits.")
    calibrate: bool = Field(default=True,
                            description="Allow a short real calibration run when the target is the local CPU, and "
                            "sizing cuDNN's convolution workspaces on the local GPU when it is the target.")
    database_url: str = Field(default_factory=lambda data: f"sqlite:///{data['data_dir'] / 'advisor.db'}",
                              description="SQLAlchemy URL of the result store (postgresql:// is accepted and means "
                              "psycopg 3).")
    sqlite_busy_timeout_s: float = Field(default=10.0, gt=0,
                                         description="How long SQLite waits for another process's lock (s).")
    trace_param_limit: int = Field(
        default=3_000_000_000, gt=0,
        description="Models with more parameters than this use the analytic path (parameters).")
    # -- the service (`advisor serve`) ------------------------------------------------------------
    api_host: str = Field(default="127.0.0.1", description="Address `advisor serve` binds (loopback unless set).")
    api_port: int = Field(default=8000, ge=1, le=65535, description="Port `advisor serve` listens on.")
    api_token: SecretStr | None = Field(default=None, description="Bearer token required by POST /v1/tune and DELETE "
                                        "/v1/jobs/{id}; unset: those routes answer 403.")
    workload_modules: str = Field(default="", description="Comma-separated module prefixes whose `pkg.module:build` "
                                  "workloads the API accepts (built-in presets always; file paths never).")
    api_max_body_bytes: int = Field(default=65_536, gt=0, description="Largest request body the API reads (bytes).")
    max_jobs: int | None = Field(default=None, gt=0, description="Tune jobs run at once; default: this machine's "
                                 "devices (GPUs, or 1 for the CPU).")
    run_jobs: bool = Field(default=True, description="`advisor serve` runs queued tune jobs itself (else run "
                           "`advisor worker` beside it).")
    ray_address: str | None = Field(default=None, description="Ray cluster the service's tune jobs join (default: a "
                                    "local Ray per job).")
    recommend_cache_s: float = Field(default=2.0, ge=0, description="How long the API serves a recommendation "
                                     "before checking the store for newer results (s).")

    def workload_module_prefixes(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.workload_modules.split(",") if p.strip())


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()

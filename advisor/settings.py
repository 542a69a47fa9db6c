"""The one settings object shared by the CLI and the API (environment prefix ADVISOR_)."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from pydantic import Field, SecretStr, field_validator
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
    # -- isolation: a workload's code runs in worker processes, never in the advisor's (advisor/isolation) -
    estimate_timeout_s: float = Field(default=600.0, gt=0, description="Time limit of one isolated call that runs a "
                                      "workload's code: loading it, an estimate, a recommendation (s).")
    estimate_memory_cap: int | None = Field(default=None, gt=0, description="Resident set an isolated call's worker "
                                            "may reach before it is killed, e.g. 4GiB (bytes; default: half of this "
                                            "machine's memory).")
    # -- the service (`advisor serve`) ------------------------------------------------------------
    api_host: str = Field(default="127.0.0.1", description="Address `advisor serve` binds (loopback unless set).")
    api_port: int = Field(default=8000, ge=1, le=65535, description="Port `advisor serve` listens on.")
    api_token: SecretStr | None = Field(default=None, description="Bearer token required by POST /v1/tune and DELETE "
                                        "/v1/jobs/{id}; unset: those routes answer 403.")
    workload_modules: str = Field(default="", description="Comma-separated module prefixes whose `pkg.module:build` "
                                  "workloads the API accepts (built-in presets always; file paths never).")
    hf_config_dirs: str = Field(default="", description="Comma-separated folders whose Hugging Face configs "
                                "(`hf:PATH`, an absolute path at or under one) the API reads; none by default.")
    api_max_body_bytes: int = Field(default=65_536, gt=0, description="Largest request body the API reads (bytes).")
    max_jobs: int | None = Field(default=None, gt=0, description="Tune jobs run at once; default: this machine's "
                                 "devices (GPUs, or 1 for the CPU).")
    run_jobs: bool = Field(default=True, description="`advisor serve` runs queued tune jobs itself (else run "
                           "`advisor worker` beside it).")
    ray_address: str | None = Field(default=None, description="Ray cluster the service's tune jobs join (default: a "
                                    "local Ray per job).")
    api_estimate_timeout_s: float = Field(default=60.0, gt=0, description="The API's time limit for an estimate or "
                                          "a recommendation's isolated call (s).")
    api_workers: int = Field(default=2, gt=0, description="Isolated workers per HTTP worker process: the estimates "
                             "and recommendations it computes at once.")
    api_queue: int = Field(default=8, ge=0, description="Requests that may wait for a busy worker; past them the API "
                           "answers 503 with Retry-After.")
    recommend_cache_s: float = Field(default=2.0, ge=0, description="How long the API serves a recommendation "
                                     "before checking the store for newer results (s).")

    @field_validator("estimate_memory_cap", mode="before")
    @classmethod
    def _size(cls, value: object) -> object:
        if isinstance(value, str) and not value.strip().isdigit():
            from advisor.render import parse_bytes

            return parse_bytes(value)
        return value

    def memory_cap_bytes(self) -> int:
        """estimate_memory_cap, or half of this machine's memory."""
        if self.estimate_memory_cap is not None:
            return self.estimate_memory_cap
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2

    def workload_module_prefixes(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.workload_modules.split(",") if p.strip())

    def hf_config_folders(self) -> tuple[Path, ...]:
        """hf_config_dirs as resolved absolute paths (symbolic links followed)."""
        return tuple(Path(p.strip()).expanduser().resolve() for p in self.hf_config_dirs.split(",") if p.strip())


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()

"""What keys stored results: configuration hashes stable across processes, hardware and software
fingerprints, and the database URL the settings and --db resolve to."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from advisor.errors import StoreError
from advisor.hardware import get_hardware
from advisor.settings import Settings
from advisor.store import config_hash, hardware_fingerprint, software_fingerprint, software_versions
from advisor.store.engine import resolve_url
from advisor.trial import TrainingConfig

ROOT = Path(__file__).resolve().parents[3]


def test_config_hash_is_stable_and_knob_sensitive():
    base = config_hash(TrainingConfig(batch_size=8))
    assert base == config_hash(TrainingConfig(batch_size=8, grad_accum=1))  # a default spelled out is the same
    assert base != config_hash(TrainingConfig(batch_size=8, num_workers=1))
    code = ("from advisor.trial import TrainingConfig as T; from advisor.store import config_hash; "
            "print(config_hash(T(batch_size=8)))")
    other = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin"})
    assert other.stdout.strip() == base  # no dependence on the process (hash seeds, dict order)


def test_hardware_and_software_fingerprints():
    cpu, h100 = get_hardware("cpu"), get_hardware("h100-sxm")
    assert hardware_fingerprint(cpu) == hardware_fingerprint(cpu.model_copy(update={"note": "probed"}))
    assert hardware_fingerprint(cpu) != hardware_fingerprint(h100)
    assert hardware_fingerprint(h100) != hardware_fingerprint(h100.model_copy(update={"devices_per_node": 8}))
    import torch

    assert software_versions()["torch"] == torch.__version__
    assert software_fingerprint() == software_fingerprint(software_versions())
    assert software_fingerprint() != software_fingerprint({**software_versions(), "torch": "0.0.1"})


def test_database_url_default_and_postgres_spelling(tmp_path, monkeypatch):
    monkeypatch.setenv("ADVISOR_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("ADVISOR_DATABASE_URL", raising=False)
    assert Settings().database_url == f"sqlite:///{tmp_path / 'advisor.db'}"
    monkeypatch.setenv("ADVISOR_DATABASE_URL", "postgresql://u@db:5432/advisor")
    assert Settings().database_url == "postgresql://u@db:5432/advisor"
    assert resolve_url("postgresql://u@db:5432/advisor") == "postgresql+psycopg://u@db:5432/advisor"
    assert resolve_url("postgres://u@db/advisor") == "postgresql+psycopg://u@db/advisor"
    assert resolve_url("postgresql+psycopg://u@db/a") == "postgresql+psycopg://u@db/a"
    with pytest.raises(StoreError, match="not supported"):
        resolve_url("mysql://u@db/advisor")

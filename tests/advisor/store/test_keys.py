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
    # a process that has not imported torch keys results as one that has, and is not made to import it
    code = ("import sys; from advisor.store import software_versions as v; before = v(); "
            "print('torch' in sys.modules); import torch; print(before == v() == "
            "{'torch': torch.__version__, 'python': v()['python'], 'cuda': torch.version.cuda})")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr[-2000:]


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


def _boolean_knob_hash(config: TrainingConfig, checkpointing: bool) -> str:
    """config_hash as it was when checkpointing was a boolean: every knob in canonical JSON, the knobs that came
    later (layout, lora_r) left out at their defaults, checkpointing as `checkpointing`."""
    import hashlib
    import json

    from advisor.store.fingerprints import LATER_DEFAULTS

    knobs = {**config.model_dump(mode="json"), "checkpointing": checkpointing}
    knobs = {k: v for k, v in knobs.items() if k not in LATER_DEFAULTS or v != LATER_DEFAULTS[k]}
    return hashlib.sha256(json.dumps(knobs, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def test_checkpointing_none_and_full_hash_as_the_booleans_did():
    full = TrainingConfig(batch_size=32, precision="bf16", strategy="ddp", nproc=2, checkpointing="full")
    none = TrainingConfig()
    assert config_hash(full) == _boolean_knob_hash(full, True)
    assert config_hash(none) == _boolean_knob_hash(none, False)
    # the hashes trials were stored under with the boolean knob
    assert config_hash(none) == "cc152f5a40696af8c16fcc84c7c708f34eb1c7cd4bd1bdfe866d1637b4281c62"
    assert config_hash(TrainingConfig(checkpointing=True)) == \
        "0c113354d3b0748550e7c264c67111ca3510d6d12e480f779a2e2b79beb6e77a"
    assert config_hash(full) == "8b162ba510f107423fc630f7f998f141eb5975689d3c496104949a364fc7e344"
    selective = TrainingConfig(checkpointing="selective")
    assert len({config_hash(selective), config_hash(none), config_hash(TrainingConfig(checkpointing=True))}) == 3


def test_measured_peaks_keep_their_keys_under_the_modes():
    import json

    from advisor.estimate import EstimateRequest
    from advisor.peaks import PeakPoint, request_key

    cpu = get_hardware("cpu:1")
    for mode, stored in (("none", False), ("full", True)):
        key = request_key("f" * 32, cpu, EstimateRequest(batch_size=2, checkpointing=mode), "none", "cpu_rss")
        assert f"|checkpointing={stored}|" in key
        line = {"fingerprint": "f" * 32, "device": "cpu", "world_size": 1, "precision": "fp32", "optimizer": "adamw",
                "strategy": "single", "checkpointing": stored, "fused_backward": False, "quantity": "cpu_rss",
                "batch_size": 2, "peak_bytes": 1}  # a point written with the boolean knob
        assert PeakPoint.model_validate_json(json.dumps(line)).key == key

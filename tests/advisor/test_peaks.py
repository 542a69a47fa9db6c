"""The measured-peak store (one contract test per implementation) and record_measured_peak."""

from __future__ import annotations

from pathlib import Path

import pytest

from advisor.errors import SpecError, StoreError
from advisor.estimate.model import EstimateRequest
from advisor.fingerprint import workload_fingerprint
from advisor.hardware import get_hardware
from advisor.peaks import JsonlPeaks, MeasuredPeaks, PeakPoint, default_peaks, device_key, record_measured_peak
from advisor.settings import get_settings
from advisor.workload import load_workload

IMPLEMENTATIONS = {"jsonl": JsonlPeaks}


def _point(batch: int, peak: int, **kw) -> PeakPoint:
    base = dict(fingerprint="f" * 32, device="cpu", world_size=1, precision="fp32", optimizer="adamw",
                strategy="single",
                checkpointing=False, fused_backward=False, quantity="cpu_rss", batch_size=batch, peak_bytes=peak)
    return PeakPoint(**(base | kw))


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def store(request, tmp_path: Path) -> MeasuredPeaks:
    return IMPLEMENTATIONS[request.param](tmp_path / "calibration")


def test_store_contract(store: MeasuredPeaks) -> None:
    a, b = _point(8, 100), _point(16, 150)
    other_knob = _point(8, 90, precision="bf16")
    other_quantity = _point(8, 80, quantity="cuda_reserved", device="h100-sxm")
    assert store.points(a.key) == []
    for p in (a, other_knob, b, other_quantity):
        store.add(p)
    assert store.points(a.key) == [a, b]  # same key, oldest first; the batch size is not in the key
    assert store.points(other_knob.key) == [other_knob]
    assert store.points(other_quantity.key) == [other_quantity]
    assert store.may_hold_points()


def test_jsonl_store_survives_a_new_instance_and_reports_a_bad_line(tmp_path: Path) -> None:
    JsonlPeaks(tmp_path).add(_point(4, 10))
    again = JsonlPeaks(tmp_path)
    assert [p.peak_bytes for p in again.points(_point(4, 10).key)] == [10]
    with open(again.path, "a") as f:
        f.write('{"fingerprint": "x"}\n')
    with pytest.raises(StoreError, match="line 2"):
        again.points(_point(4, 10).key)


def test_empty_jsonl_store_says_so(tmp_path: Path) -> None:
    assert not JsonlPeaks(tmp_path / "none").may_hold_points()


def test_default_store_lives_under_the_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADVISOR_DATA_DIR", str(tmp_path))
    get_settings.cache_clear()
    try:
        assert default_peaks().path == tmp_path / "calibration" / "peaks.jsonl"
    finally:
        get_settings.cache_clear()


def test_record_measured_peak_keys_by_fingerprint_device_and_knobs(tmp_path: Path) -> None:
    store = JsonlPeaks(tmp_path)
    wl = load_workload("tiny-mlp")
    req = EstimateRequest(batch_size=32, precision="bf16", optimizer="sgd-momentum", checkpointing=True)
    host = get_hardware("cpu")
    p = record_measured_peak(wl, host, req, "default", 123_000_000, "cpu_rss", 120_000_000, store=store)
    # this host's CPU by its model: a data dir carried to another host keeps its resident sets apart
    assert (p.fingerprint, p.device, p.batch_size, p.peak_bytes, p.predicted_bytes) == (
        workload_fingerprint(wl), f"cpu:{host.accelerator.cpu.model_name}", 32, 123_000_000, 120_000_000)
    other_cpu = host.model_copy(update={"accelerator": host.accelerator.model_copy(
        update={"cpu": host.accelerator.cpu.model_copy(update={"model_name": "Another CPU"})})})
    assert device_key(other_cpu) != p.device
    assert (p.precision, p.optimizer, p.checkpointing, p.compile_mode, p.quantity) == (
        "bf16", "sgd-momentum", "full", "default", "cpu_rss")
    assert store.points(p.key) == [p]
    gpu = record_measured_peak(wl, get_hardware("h100-sxm:8"), EstimateRequest(batch_size=32, strategy="ddp"), "none",
                               2**30, "cuda_reserved", None, store=store)
    assert (gpu.device, gpu.world_size, gpu.strategy) == ("h100-sxm", 8, "ddp")
    with pytest.raises(SpecError, match="quantity"):
        record_measured_peak(wl, get_hardware("cpu"), req, "none", 1, "rss", None, store=store)

"""Calibrations kept across processes (advisor/estimate/resident/calcache.py): what keys them, a round trip
with and without real traces, and a torn file ignored rather than trusted."""

from __future__ import annotations

import numpy as np

from advisor.config import OptimizerKind, Precision
from advisor.estimate.batchmodel import BatchModel
from advisor.estimate.resident import calcache
from advisor.estimate.resident.calibration import Calibration
from advisor.estimate.trace import trace_training
from advisor.workload import load_workload

REQUEST = {"batch_size": 16, "precision": "fp32", "optimizer": "adamw"}


def _model(b: int = 8) -> BatchModel:
    wl = load_workload("tiny-mlp")
    kw = dict(precision=Precision.fp32, optimizer=OptimizerKind.adamw, count_flops=False)
    return BatchModel(a=b, trace_a=trace_training(wl, b, **kw), c=b // 2, trace_c=trace_training(wl, b // 2, **kw))


def test_the_key_follows_the_workload_the_request_and_the_estimators_sources() -> None:
    key = calcache.calibration_key("tiny-mlp", {}, "f" * 32, REQUEST)
    assert key == calcache.calibration_key("tiny-mlp", {}, "f" * 32, dict(REQUEST))
    assert key != calcache.calibration_key("tiny-mlp", {"hidden": 64}, "f" * 32, REQUEST)
    assert key != calcache.calibration_key("tiny-mlp", {}, "e" * 32, REQUEST)
    assert key != calcache.calibration_key("tiny-mlp", {}, "f" * 32, {**REQUEST, "precision": "bf16"})
    assert set(calcache.host_identity()) == {"cpu", "cpus", "torch", "libc"}


def test_a_calibration_round_trips_with_its_real_traces(tmp_path) -> None:
    fake, real = _model(8), _model(4)
    kept = Calibration(intercept=1e8, slope=1.2, hidden_ratio=0.05, spread=3e6, batches=(2, 3, 4),
                       used_real_traces=False,
                       rss=((2, 300_000_000, 8 << 20), (3, 310_000_000, 12 << 20), (4, 322_000_000, None)))
    calcache.save("k1", kept, fake, tmp_path)
    calib, bm = calcache.load("k1", fake, tmp_path)
    assert calib == kept and bm is fake  # the fake model is rebuilt by every estimate: not stored
    with_real = Calibration(**{**kept.__dict__, "used_real_traces": True})
    calcache.save("k2", with_real, real, tmp_path)
    calib, bm = calcache.load("k2", fake, tmp_path)
    assert calib == with_real and (bm.a, bm.c) == (real.a, real.c)
    assert np.array_equal(bm.at(4).curve, real.at(4).curve) and bm.at(3).peak_bytes == real.at(3).peak_bytes


def test_a_torn_or_missing_file_is_ignored(tmp_path) -> None:
    fake = _model(8)
    assert calcache.load("absent", fake, tmp_path) is None
    (tmp_path / "torn.json").write_text('{"version": 1, "calibration": {"intercept": 1')
    assert calcache.load("torn", fake, tmp_path) is None

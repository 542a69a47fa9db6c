"""The heap replayed at a batch no run reached (advisor.estimate.heaplog): real logged runs, the real
logger and replayer built with this machine's C compiler, against real runs at the batch."""

from __future__ import annotations

import re
import statistics

import numpy as np
import pytest

from advisor.estimate import estimate_memory, heaplog
from advisor.measure import MeasureRequest, measure

MiB = 1 << 20

needs_tools = pytest.mark.skipif(heaplog.tools() is None,
                                 reason="heaplog's logger cannot be built here: it needs Linux with glibc and a C compiler")


def test_tensor_requests_are_resized_as_the_trace_resizes_them_and_nothing_else_is() -> None:
    # Trace.sizes at two batch sizes: +bytes per allocation, -bytes per free, in the same order at both.
    # 100 grows to 200 twice and stays once (a weight of the same size as an activation): most say 200.
    at_2 = np.array([100, 100, 300, -100, 100, 700, -700])
    at_4 = np.array([200, 200, 300, -200, 100, 1400, -1400])
    keys, values = heaplog.size_map(at_2, at_4)
    assert keys.tolist() == [100, 300, 700] and values.tolist() == [200, 300, 1400]
    log = np.array([[heaplog.POSIX_MEMALIGN, 0x1000, 100, 64], [heaplog.MALLOC, 0x2000, 100, 0],
                    [heaplog.POSIX_MEMALIGN, 0x3000, 700, 64], [heaplog.POSIX_MEMALIGN, 0x4000, 50, 64],
                    [heaplog.FREE, 0x1000, 0, 0]], dtype=np.uint64)
    out = heaplog.rescale(log, keys, values)
    # tensors (posix_memalign, torch's CPU allocator) resized; a malloc of the same size and an unknown size kept
    assert out[:, 2].tolist() == [200, 100, 1400, 50, 0]
    assert (out[:, [0, 1, 3]] == log[:, [0, 1, 3]]).all()


@needs_tools
def test_a_draw_starts_the_heap_with_its_seed_bytes_held_and_seed_zero_with_none(tmp_path) -> None:
    """The replayer under a seed holds 16 B to 128 KiB before the log's first request (it says how many on
    stderr: the resident set's counters are too coarse to tell 128 KiB apart), the same bytes each time that
    seed is drawn, other bytes for other seeds; seed 0 holds none, and replays a log as logged."""
    import subprocess

    log = tmp_path / "one.heaplog"
    np.array([[heaplog.POSIX_MEMALIGN, 0x1000, 8 * MiB, 64], [heaplog.FREE, 0x1000, 0, 0]], dtype=np.uint64).tofile(log)

    def held(seed: int) -> int:
        p = subprocess.run([str(heaplog.tools().replay), str(log), str(seed)], capture_output=True, text=True, check=True)
        m = re.fullmatch(r"held (\d+)\n", p.stderr)
        return int(m.group(1)) if m else 0

    assert held(0) == 0 and heaplog.replay(log) >= 7.5 * MiB  # the 8 MiB, written
    drawn = {s: held(s) for s in range(1, 9)}
    assert all(16 <= z <= 128 * 1024 and z % 16 == 0 for z in drawn.values()) and len(set(drawn.values())) >= 6
    assert held(3) == drawn[3]
    assert heaplog.replay(log, seed=3) >= 7.5 * MiB


def test_the_draws_are_pooled_as_their_median_plus_the_runs_mean_excess() -> None:
    runs = [heaplog.Replayed(excess=10, at_target=(100, 300, 200)), heaplog.Replayed(excess=30, at_target=(150, 400, 250))]
    assert heaplog.pooled(runs) == 225 + 20
    assert heaplog.pooled(runs[:1]) == 200 + 10


@needs_tools
def test_a_logged_run_rescaled_to_a_larger_batch_and_replayed_predicts_a_run_there(tmp_path) -> None:
    """tiny-gpt2 logged at batch 8, replayed as logged and rescaled to 32 (the trace's sizes at 8 and 32):
    its own replay holds at least the step's live tensor peak and less than the run measured (the rest is the
    process's own pages: code first run, Python's arenas), and the prediction at 32 lies within 8% of the
    median of three real runs there. The log is not in the run's resident set: a logged run measures as an
    unlogged one does."""
    from advisor.config import OptimizerKind, Precision
    from advisor.estimate.estimator import _batch_model, _make_request
    from advisor.hardware import get_hardware
    from advisor.workload import load_workload

    log = str(tmp_path / "run.heaplog")
    logged = measure(MeasureRequest(workload="tiny-gpt2", batch_size=8, heap_log=log)).rss_delta_bytes
    plain = [measure(MeasureRequest(workload="tiny-gpt2", batch_size=8)).rss_delta_bytes for _ in range(2)]
    records = heaplog.read_log(log)
    assert (records[:, 0] == heaplog.POSIX_MEMALIGN).sum() > 100 and (records[:, 0] == heaplog.FREE).sum() > 1000
    assert abs(logged - statistics.mean(plain)) < 0.05 * logged, (logged, plain)
    req = _make_request(get_hardware("local"), 32, precision=Precision.fp32, optimizer=OptimizerKind.adamw,
                        strategy="single", checkpointing=False, fused_backward=False, offload_optimizer=False,
                        offload_params=False, optimizer_impl=None)
    bm = _batch_model(load_workload("tiny-gpt2", {}), req, cpu=True)
    own = heaplog.replay(log)
    assert 0.95 * bm.at(8).peak_bytes < own < logged, (own / MiB, bm.at(8).peak_bytes / MiB, logged / MiB)
    drawn = heaplog.replay_at(log, logged, None, bm.at(8).sizes, bm.at(32).sizes)
    assert len(drawn.at_target) == heaplog.DRAWS and 0 < drawn.excess < logged
    at_32 = heaplog.pooled([drawn])
    # the same seeds drawn again: the same heaps, up to the kernel's resident-set counters (tens of KiB)
    assert at_32 == pytest.approx(heaplog.predict(log, logged, None, bm.at(8).sizes, bm.at(32).sizes), rel=0.01)
    real = statistics.median(measure(MeasureRequest(workload="tiny-gpt2", batch_size=32)).rss_delta_bytes
                             for _ in range(3))
    assert at_32 > logged + 0.5 * (bm.at(32).peak_bytes - bm.at(8).peak_bytes)  # the batch's bytes are in it
    assert abs(at_32 - real) < 0.08 * real, (at_32 / MiB, real / MiB)


@needs_tools
def test_a_batch_past_its_runs_leans_on_their_heap_replayed_there_as_on_one_run() -> None:
    """tiny-gpt2 at 16 on this CPU: runs at 2, 4 and twice at 8, logged; their heap replayed at 16 stands as
    one run there, so the estimate lies half way from the fit's line to it (the note gives both), and a
    search comparing batch sizes keeps the line."""
    from advisor.estimate.calibrate import Calibration
    from advisor.estimate.estimator import _CALIBRATIONS

    est = estimate_memory("tiny-gpt2", "cpu", 16, calibrate=True, measured=False)
    note = next(n for n in est.notes if n.startswith("resident set at batch 16"))
    m = re.search(r"batch 16: (\d+) MiB, the fit's (\d+) MiB drawn 1/2 of the way .* glibc, \d times each .*\((\d+) MiB, the draws' median, weighed as one run\)",
                  note)
    assert m, note
    at, line, replayed = map(int, m.groups())
    assert abs(at - (line + replayed) / 2) <= 1.0, note
    # this estimate's calibration: the one replayed at 16 to the figure its note gives (other tests' are kept too)
    calib = next(c for c, _ in _CALIBRATIONS.values() if isinstance(c, Calibration) and len(c.replayed) == 1
                 and c.replayed[0][0] == 16 and abs(c.replayed[0][1] / MiB - replayed) <= 0.5)
    assert not calib.runs_at(16) and sorted({b for b, _, _ in calib.rss}) == [2, 4, 8]
    lone = Calibration(intercept=calib.intercept, slope=calib.slope, rss=calib.rss, replayed=calib.replayed)
    assert lone.at_batch(16, 100 * MiB) == pytest.approx(100 * MiB + (calib.replayed[0][1] - 100 * MiB) / 2)
    assert lone.at_batch(12, 100 * MiB) == 100 * MiB  # replayed at 16 only


def test_without_a_c_compiler_nothing_is_logged_and_the_calibration_goes_without(tmp_path, monkeypatch) -> None:
    from advisor.estimate.calibrate import replays_heap
    from advisor.settings import get_settings

    monkeypatch.setenv("ADVISOR_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, no gcc
    get_settings.cache_clear()
    try:
        assert heaplog.tools() is None
        assert not replays_heap(at_batch=0, target=None)
    finally:
        get_settings.cache_clear()
    assert not (tmp_path / "heaplog").exists() or not any((tmp_path / "heaplog").rglob("replay"))

"""The heap replayed at a batch no run reached (advisor.estimate.resident.heaplog): real logged runs, the real
logger and replayer built with this machine's C compiler, against real runs at the batch."""

from __future__ import annotations

import re
import statistics

import numpy as np
import pytest

from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory
from advisor.estimate.resident import heaplog
from advisor.measure import MeasureRequest, measure

MiB = 1 << 20

needs_tools = pytest.mark.skipif(heaplog.tools() is None,
                                 reason="heaplog's logger cannot be built here: "
                                        "it needs Linux with glibc and a C compiler")


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


def test_a_zero_byte_allocation_at_one_batch_keeps_the_size_map_aligned() -> None:
    # a probed op's scratch: 0 bytes at batch 2, 64 at batch 4; the allocations after it still pair up in order
    at_2 = np.array([100, 0, 300, -300])
    at_4 = np.array([200, 64, 600, -600])
    keys, values = heaplog.size_map(at_2, at_4)
    assert keys.tolist() == [100, 300] and values.tolist() == [200, 600]


def _marked(records: list[tuple[int, int]]) -> np.ndarray:
    """A log from (operation, bytes) records; MARK records number themselves from 1, as a logged run's do."""
    rows, n = [], 0
    for i, (op, size) in enumerate(records):
        if op == heaplog.MARK:
            n += 1
            rows.append([op, 0, n, 0])
        else:
            rows.append([op, 0x1000 * (i + 1), size, 64 if op == heaplog.POSIX_MEMALIGN else 0])
    return np.array(rows, dtype=np.uint64)


def test_a_size_the_trace_resizes_two_ways_is_resized_as_its_allocation_in_the_same_phase() -> None:
    """A 100-byte weight and 100-byte activations at batch 2 (the activations grow to 200 at 4, the weight and
    the optimizer's 100-byte temporary stay): by size alone every 100-byte request grows or none does; in a
    log whose phases are marked, each one as the trace's allocation it matches in its phase, a third step as the
    second, a request past the trace's in its phase as most of that phase's, and other requests as before."""
    pm, mark = heaplog.POSIX_MEMALIGN, heaplog.MARK
    # the trace: build (phase 0: the weight), then two steps of batch, forward, backward, step, done (1-5, 6-10)
    step = [(1, 100, 200), (2, 100, 200), (2, 100, 200), (3, 300, 600), (4, 100, 100)]
    events = [(0, 100, 100)] + step + [(q + 5, a, b) for q, a, b in step]
    at_2 = np.array([a for _, a, _ in events])
    at_4 = np.array([b for _, _, b in events])
    phases = np.array([q for q, _, _ in events])
    keys, values = heaplog.size_map(at_2, at_4)
    assert dict(zip(keys.tolist(), values.tolist()))[100] == 200  # the activations are the most

    def logged_step(extra: bool = False) -> list[tuple[int, int]]:
        forward = [(pm, 100), (pm, 100)] + [(pm, 100)] * extra + [(heaplog.MALLOC, 100)]
        return [(mark, 0), (pm, 100), (mark, 0), *forward, (mark, 0), (pm, 300), (mark, 0), (pm, 100), (mark, 0)]

    log = _marked([(pm, 100)] + logged_step() + logged_step(extra=True) + logged_step())
    out = heaplog.rescaled(log, at_2, at_4, phases)
    tensors = [int(size) for op, _, size, _ in out if op == pm]
    # build; step 1; step 2 with a third forward request past the trace's two; step 3 as step 2
    assert tensors == [100, 200, 200, 200, 600, 100,
                       200, 200, 200, 200, 600, 100,
                       200, 200, 200, 600, 100]
    assert [int(r[2]) for r in out if r[0] == heaplog.MALLOC] == [100, 100, 100]  # not a tensor: as logged
    assert (out[:, [0, 1, 3]] == log[:, [0, 1, 3]]).all() and (out[log[:, 0] == mark] == log[log[:, 0] == mark]).all()
    # unmarked (a log from before the marks), or no phases: by size alone, as `rescale` does
    plain = log[log[:, 0] != mark]
    assert (heaplog.rescaled(plain, at_2, at_4, phases) == heaplog.rescale(plain, keys, values)).all()
    assert (heaplog.rescaled(log, at_2, at_4, None) == heaplog.rescale(log, keys, values)).all()


@needs_tools
def test_a_logged_run_marks_its_phases_and_its_requests_resize_phase_by_phase_as_the_trace(tmp_path) -> None:
    """An MLP whose 256 x 256 weights (and their gradients and Adam's state) are as large as its activations at
    batch 256, logged there, its log resized to batch 1024: each phase of each of its three steps asks for the
    tensor bytes the trace allocates in that phase at 1024 (within 1%; the first step's optimizer state is made
    in its own). By size alone, the activations' 256 KiB requests stayed 256 KiB: a quarter of the batch's."""
    from advisor.estimate.estimator import _batch_model
    from advisor.estimate.model import EstimateRequest
    from advisor.workload import load_workload

    args = {"in_features": 256, "hidden": 256, "layers": 4}
    log = str(tmp_path / "run.heaplog")
    measure(MeasureRequest(workload="mlp", workload_args=args, batch_size=256, heap_log=log))
    records = heaplog.read_log(log)
    marks = records[:, 0] == heaplog.MARK
    assert records[marks, 2].tolist() == list(range(1, 16))  # batch, forward, backward, step, done; 3 steps
    bm = _batch_model(load_workload("mlp", args), EstimateRequest(batch_size=1024), cpu=True)
    run, at = bm.at(256), bm.at(1024)
    out = heaplog.rescaled(records, run.sizes, at.sizes, run.phases)
    tensors, logged = out[:, 0] == heaplog.POSIX_MEMALIGN, np.cumsum(marks)
    grew = 0
    for p in range(1, 16):
        q = heaplog.traced_phase(np.array([p]))[0]
        traced = int(at.sizes[(run.sizes > 0) & (run.phases == q)].sum())
        asked = int(out[tensors & (logged == p), 2].sum())
        assert abs(asked - traced) <= 0.01 * traced + 4096, (p, asked, traced)
        grew += asked - int(records[tensors & (logged == p), 2].sum())
    assert grew > 3 * 15 * 256 * 256 * 4  # what the activations grew by


@needs_tools
def test_a_draw_starts_the_heap_with_its_seed_bytes_held_and_seed_zero_with_none(tmp_path) -> None:
    """The replayer under a seed holds 16 B to 128 KiB before the log's first request (it says how many on
    stderr: the resident set's counters are too coarse to tell 128 KiB apart), the same bytes each time that
    seed is drawn, other bytes for other seeds; seed 0 holds none, and replays a log as logged."""
    import subprocess

    log = tmp_path / "one.heaplog"
    np.array([[heaplog.POSIX_MEMALIGN, 0x1000, 8 * MiB, 64], [heaplog.FREE, 0x1000, 0, 0]], dtype=np.uint64).tofile(log)

    def held(seed: int) -> int:
        p = subprocess.run([str(heaplog.tools().replay), str(log), str(seed)], capture_output=True, text=True,
                           check=True)
        m = re.fullmatch(r"held (\d+)\n", p.stderr)
        return int(m.group(1)) if m else 0

    assert held(0) == 0 and heaplog.replay(log) >= 7.5 * MiB  # the 8 MiB, written
    drawn = {s: held(s) for s in range(1, 9)}
    assert all(16 <= z <= 128 * 1024 and z % 16 == 0 for z in drawn.values()) and len(set(drawn.values())) >= 6
    assert held(3) == drawn[3]
    assert heaplog.replay(log, seed=3) >= 7.5 * MiB


def test_the_draws_are_pooled_as_their_median_plus_the_runs_mean_excess() -> None:
    runs = [heaplog.Replayed(excess=10, at_target=(100, 300, 200)),
            heaplog.Replayed(excess=30, at_target=(150, 400, 250))]
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
    from advisor.estimate.estimator import _batch_model
    from advisor.workload import load_workload

    log = str(tmp_path / "run.heaplog")
    logged = measure(MeasureRequest(workload="tiny-gpt2", batch_size=8, heap_log=log)).rss_delta_bytes
    plain = [measure(MeasureRequest(workload="tiny-gpt2", batch_size=8)).rss_delta_bytes for _ in range(2)]
    records = heaplog.read_log(log)
    assert (records[:, 0] == heaplog.POSIX_MEMALIGN).sum() > 100 and (records[:, 0] == heaplog.FREE).sum() > 1000
    assert abs(logged - statistics.mean(plain)) < 0.05 * logged, (logged, plain)
    req = EstimateRequest.of(32, precision=Precision.fp32, optimizer=OptimizerKind.adamw, strategy="single",
                             checkpointing=False, fused_backward=False, offload_optimizer=False, offload_params=False,
                             optimizer_impl=None)
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
    from advisor.estimate.resident.calibration import Calibration
    from advisor.estimate.resident.measured import _CALIBRATIONS

    est = estimate_memory("tiny-gpt2", "cpu", EstimateRequest(batch_size=16),
                          EstimateOptions(calibrate=True, measured=False))
    note = next(n for n in est.notes if n.startswith("resident set at batch 16"))
    m = re.search(r"batch 16: (\d+) MiB, the fit's (\d+) MiB drawn 1/2 of the way .* glibc, \d times each "
                  r".*\((\d+) MiB, the draws' median, weighed as one run\)",
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
    from advisor.estimate.resident.calibrate import replays_heap
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

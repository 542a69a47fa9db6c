"""Workloads whose code aborts, hangs, raises, exits or eats memory, run through the CLI as a user runs it:
`advisor estimate` says what happened in one line and exits 1, `advisor trial` records the failure's status
and stays within its time limit, `advisor tune` finishes its study with every trial recorded (or, for a
workload that cannot even be loaded, fails in one line before any study exists); and none of them leaves a
process behind (each run's processes are found by the data dir their environment names)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAILING = f"{ROOT / 'tests' / 'failing_workload.py'}:build"
EXITING = f"{ROOT / 'tests' / 'exiting_workload.py'}:build"
CAP = "1500MB"  # the hog's memory cap: well above a worker's own resident set (torch loaded)
GRACE_S = 15.0  # for the processes of a finished run to be gone (Ray's stop is not instant)


def _processes_of(data_dir: Path) -> list[int]:
    """Pids of live processes whose environment names `data_dir`: the CLI and everything it started."""
    marker = f"ADVISOR_DATA_DIR={data_dir}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue  # exited while we looked, or not ours to read
    return found


@pytest.fixture
def data_dir():
    """A data dir of the test's own (short: Ray's socket paths live under it); afterwards no process names it."""
    d = Path(tempfile.mkdtemp(prefix="advf-", dir="/tmp"))
    yield d
    deadline = time.monotonic() + GRACE_S
    while (left := _processes_of(d)) and time.monotonic() < deadline:
        time.sleep(0.25)
    for pid in left:  # found by this test's own data dir: started by it
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(d, ignore_errors=True)
    assert not left, f"processes left behind by the run: {left}"


def advisor(data_dir: Path, *args: str, env: dict[str, str] | None = None,
            timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    """`advisor ARGS` in a fresh process with the test's data dir; (the process, its wall time in seconds)."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "advisor.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "ADVISOR_DATA_DIR": str(data_dir), **(env or {})}, timeout=timeout)
    return proc, time.monotonic() - t0


ESTIMATES = {  # mode: (the workload, extra environment, what the one line says)
    "abort": (FAILING, {}, "the workload's loss crashed (SIGABRT) while tracing failing-abort at batch 8"),
    "hang": (FAILING, {"ADVISOR_ESTIMATE_TIMEOUT_S": "6"},
             "the workload's loss did not finish within 6 s while tracing failing-hang at batch 8"),
    # a loss that raises on fake tensors is run on real ones (in fresh processes), where it raises again
    "raise": (FAILING, {}, "RuntimeError: the loss failed on purpose"),
    "hog": (FAILING, {"ADVISOR_ESTIMATE_MEMORY_CAP": CAP}, "past the memory cap of 1,431 MiB"),
    "exit": (EXITING, {}, "the workload's import exited (SystemExit: 3)"),
}


@pytest.mark.parametrize("mode", list(ESTIMATES))
def test_estimate_of_a_failing_workload_is_one_line_and_exit_1(data_dir, mode):
    workload, env, says = ESTIMATES[mode]
    proc, _ = advisor(data_dir, "estimate", "-w", workload, "-a", f"mode={mode}", "-H", "cpu", "--no-calibrate",
                      env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("advisor estimate: ") and says in lines[0], proc.stderr[-3000:]
    if mode == "hog":
        assert "the workload's model reached" in lines[0]


TRIALS = {  # mode: (the workload, its status, what its error says)
    "abort": (FAILING, "crashed", "SIGABRT"),
    "hang": (FAILING, "timeout", "no result within 20 s"),
    "raise": (FAILING, "error", "RuntimeError: the loss failed on purpose"),
    "exit": (EXITING, "error", "the workload's import exited (SystemExit: 3)"),
    "hog": (FAILING, "oom", "the workload's model reached"),
}
TRIAL_TIMEOUT_S = 20


@pytest.mark.parametrize("mode", list(TRIALS))
def test_trial_of_a_failing_workload_records_its_status_within_the_time_limit(data_dir, mode):
    workload, status, says = TRIALS[mode]
    cap = ["--memory-cap", CAP] if mode == "hog" else []
    proc, wall = advisor(data_dir, "trial", "-w", workload, "-a", f"mode={mode}", "-H", "local", "--set",
                         "batch_size=8", "--timeout", str(TRIAL_TIMEOUT_S), "--settle", "0", "--json", *cap)
    assert proc.returncode == 1, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["status"] == status and says in result["error"], result
    # the trial's limit holds for the whole command: loading and estimating the workload included
    assert wall < TRIAL_TIMEOUT_S + 10, wall
    if mode == "abort":  # the estimate crashed in its worker first, and the trial measured what the ranks did
        assert any("no estimate: the workload's loss crashed (SIGABRT)" in n for n in result["notes"]), result


def _tune(data_dir: Path, workload: str, mode: str, trial_timeout_s: float,
          env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """`advisor tune` of `mode` at the smallest budget: three configurations, one timed step each."""
    return advisor(data_dir, "tune", "-w", workload, "-a", f"mode={mode}", "-H", "cpu", "--space", "quick",
                   "--trials", "3", "--min-time", "0", "--min-steps", "1", "--trial-timeout", f"{trial_timeout_s:g}",
                   "--settle", "0", "--json", env=env, timeout=240)


def _study(data_dir: Path):
    """The data dir's one study and its trials, read from its store."""
    from advisor.store import open_store

    store = open_store(f"sqlite:///{data_dir / 'advisor.db'}")
    try:
        studies, total = store.list_studies()
        assert total == 1, studies
        return studies[0], store.study_trials(studies[0].id)
    finally:
        store.close()


def _finished_with(data_dir: Path, proc: subprocess.CompletedProcess, status: str, says: str):
    """The tune run exited 0 with its study finished: three distinct configurations, each `status`, none
    running, every error saying `says`; the study's trials."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["statuses"] == {status: 3} and summary["best"] is None, summary
    study, trials = _study(data_dir)
    assert study.status == "finished" and study.finished_at is not None, study
    assert len(trials) == 3 and len({t.config_hash for t in trials}) == 3, trials
    assert all(t.status == status and says in t.result.error for t in trials), [(t.status, t.error) for t in trials]
    assert all(t.attempt == 1 for t in trials), [t.attempt for t in trials]  # no trial was run twice
    return trials


def test_tune_of_a_workload_that_aborts_finishes_its_study_with_every_trial_recorded(data_dir):
    proc, _ = _tune(data_dir, FAILING, "abort", 60)
    _finished_with(data_dir, proc, "crashed", "SIGABRT")


def test_tune_of_a_workload_that_raises_finishes_its_study_with_every_trial_an_error(data_dir):
    proc, _ = _tune(data_dir, FAILING, "raise", 60)
    trials = _finished_with(data_dir, proc, "error", "RuntimeError: the loss failed on purpose")
    for t in trials:  # the pruning estimate failed and says so; the trial did not spend its time failing it again
        assert t.estimate["reason"].startswith("no estimate") and t.estimate["total_bytes"] is None, t.estimate
        assert not any(n.startswith("no estimate") for n in t.result.notes), t.result.notes


HANG_TIMEOUT_S = 4
# Each trial: the pruning estimate (half the trial's time), then the trial itself; plus the tuner's start and
# stop, the store and loading the workload, which take well under a minute on two busy cores.
HANG_BOUND_S = 3 * 1.5 * HANG_TIMEOUT_S + 75


def test_tune_of_a_workload_that_hangs_times_every_trial_out_within_its_limit(data_dir):
    proc, wall = _tune(data_dir, FAILING, "hang", HANG_TIMEOUT_S)
    trials = _finished_with(data_dir, proc, "timeout", f"no result within {HANG_TIMEOUT_S} s")
    for t in trials:  # the estimate that decides pruning had half the trial's time, then the trial its own
        assert f"did not finish within {HANG_TIMEOUT_S / 2:g} s" in t.estimate["reason"], t.estimate
        assert t.result.wall_s < HANG_TIMEOUT_S + 2, t.result
    assert wall < HANG_BOUND_S, wall


TUNE_UNLOADABLE = {  # mode: (the workload, extra environment, what the one line says)
    "hog": (FAILING, {"ADVISOR_ESTIMATE_MEMORY_CAP": CAP}, "the workload's model reached"),
    "exit": (EXITING, {}, "the workload's import exited (SystemExit: 3)"),
}


@pytest.mark.parametrize("mode", list(TUNE_UNLOADABLE))
def test_tune_of_a_workload_that_cannot_load_fails_fast_without_a_study(data_dir, mode):
    workload, env, says = TUNE_UNLOADABLE[mode]
    timeout_s = 60
    proc, wall = _tune(data_dir, workload, mode, timeout_s, env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("advisor tune: ") and says in lines[0], proc.stderr[-3000:]
    if mode == "hog":
        assert "past the memory cap of 1,431 MiB" in lines[0], lines
    # Ray starts beside the loading and goes with it: no store, no study, no Ray left
    assert not (data_dir / "advisor.db").exists() and not (data_dir / "ray").exists(), list(data_dir.iterdir())
    # within one trial's time limit, so no trial ran (7 s alone on two cores, over 30 s beside busy tests)
    assert wall < timeout_s, wall

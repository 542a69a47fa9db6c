"""Workloads whose code aborts, hangs, raises, exits or eats memory, run through the CLI as a user runs it:
`advisor estimate` says what happened in one line and exits 1, `advisor trial` records the failure's status
and stays within its time limit, `advisor tune` finishes its study with every trial recorded; and none of
them leaves a process behind (each run's processes are found by the data dir their environment names)."""

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


def test_tune_of_a_workload_that_aborts_finishes_its_study_with_every_trial_recorded(data_dir):
    proc, wall = advisor(data_dir, "tune", "-w", FAILING, "-a", "mode=abort", "-H", "cpu", "--space", "quick",
                         "--trials", "3", "--min-time", "0.3", "--min-steps", "3", "--trial-timeout", "60",
                         "--settle", "0", "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["statuses"] == {"crashed": 3} and summary["best"] is None, summary
    listed, _ = advisor(data_dir, "results", "list", "--json")
    assert listed.returncode == 0, listed.stderr[-3000:]
    rows = json.loads(listed.stdout)
    assert len(rows) == 3 and len({r["config_hash"] for r in rows}) == 3
    assert all(r["status"] == "crashed" and "SIGABRT" in r["result"]["error"] for r in rows), rows

"""`advisor serve` and `advisor worker` refuse bad input in one line with exit 2, before binding
anything; `advisor serve` says where it listens and what store it serves."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from api_common import ROOT, free_port


def advisor(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "advisor.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


@pytest.mark.parametrize("args,says", [
    (["serve", "--port", "70000"], "give 1 to 65535"),
    (["serve", "--port", "http"], "invalid int value"),
    (["serve", "--db", "mysql://x/y"], "not supported"),
    (["serve", "--http-workers", "0"], "not positive"),
    (["worker", "--db", "mysql://x/y"], "not supported"),
])
def test_bad_serve_options_exit_2_in_one_line(args, says):
    proc = advisor(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in proc.stderr


def test_serve_announces_itself_and_stops_on_sigterm(sqlite_url, short_data_dir):
    import os
    import signal
    import time

    port = free_port()
    env = {**os.environ, "ADVISOR_DATA_DIR": str(short_data_dir), "ADVISOR_RUN_JOBS": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "advisor.cli", "serve", "--port", str(port), "--db", sqlite_url],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}/" in line and "SQLite file" in line and "not run here" in line
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).json()["store"] == "ok"
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            raise AssertionError("no answer from advisor serve")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0

"""The storage logger: under its preloaded shim a process logs every tensor storage's allocation and free, on
any thread, and the replay gives the peak of live tensor bytes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from advisor import alloclog

CHILD = r"""
import os, threading
import torch
from advisor import alloclog

assert alloclog.active()
path = os.environ["LOG"]
alloclog.start(path)
a = torch.empty(1000, 1000)               # 4,000,000 bytes
b = torch.empty(500, 1000)                # 2,000,000: 6,000,000 live
held = [a]
del a
t = threading.Thread(target=held.clear)   # its last reference dropped on another thread, as gloo's workers do
t.start(); t.join()
c = torch.empty(1500, 1000)               # 6,000,000: 8,000,000 live, the peak, only if the free was seen
alloclog.stop()
d = torch.empty(10_000_000)               # after stop: not logged
print(alloclog.replay(path))
"""


def test_the_shim_logs_every_threads_storages_and_the_replay_gives_their_peak(tmp_path: Path) -> None:
    shim = alloclog.shim_path(tmp_path / "build")
    if shim is None:
        pytest.skip("no gcc to build the shim")
    env = dict(os.environ, LD_PRELOAD=shim, LOG=str(tmp_path / "alloc.log"))
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) == 8_000_000
    assert alloclog.shim_path(tmp_path / "build") == shim  # built once, then reused


def test_without_the_shim_nothing_is_logged(tmp_path: Path) -> None:
    assert not alloclog.active()  # the test process runs without LD_PRELOAD
    assert not alloclog.start(str(tmp_path / "never.log"))
    assert not (tmp_path / "never.log").exists()
    env = alloclog.preload_env({"LD_PRELOAD": "libother.so"})
    assert env["LD_PRELOAD"].endswith("libother.so") and "alloc_log" in env["LD_PRELOAD"]

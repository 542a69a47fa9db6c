"""The resident-set peak a fresh measuring process reports is its own, whatever launched it."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from advisor.errors import TrialError
from advisor.estimate.resident.calibrate import _run_parallel
from advisor.measure import PROFILED_MMAP_THRESHOLD, MeasureRequest, child_env, measure
from advisor.procmem import MMAP_THRESHOLD_MAX, available_bytes, current_rss, malloc_env, mark_peak, peak_rss

MB = 2**20


def test_a_measurement_launched_by_a_large_process_reports_its_own_peak():
    # Linux carries ru_maxrss over an exec, so a child of this process would report at least the
    # 1.5 GiB held here; the real tiny-mlp step peaks far below it.
    held = bytearray(1536 * MB)
    held[::4096] = b"\x01" * len(held[::4096])  # touch every page: resident
    assert current_rss() > 1536 * MB
    r = measure(MeasureRequest(workload="tiny-mlp", batch_size=8, mode="rss"))
    del held
    assert 0 < r.rss_delta_bytes < 400 * MB, r.rss_delta_bytes
    assert r.baseline_rss_bytes < 1024 * MB


def test_mark_peak_resets_the_high_water_mark():
    spike = bytearray(256 * MB)
    spike[::4096] = b"\x01" * len(spike[::4096])
    del spike
    before = peak_rss()
    assert mark_peak()
    assert peak_rss() < before - 200 * MB  # the freed spike no longer counts
    assert peak_rss() >= current_rss() - 8 * MB


# A child that mallocs 16 MiB and prints how many chunks glibc mapped on their own for it (mallinfo2's hblks).
_MAPPED_CHUNKS = """
import ctypes
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
before = libc.mallinfo2().hblks
p = libc.malloc(16 << 20)
print(libc.mallinfo2().hblks - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc tunables; this libc is another")
def test_malloc_env_fixes_glibcs_mmap_threshold_in_the_child_and_none_leaves_its_default(monkeypatch):
    # a user's own setting, under which 16 MiB would come from the heap: None must not pass it on
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD_MAX))

    def mapped(threshold):
        out = subprocess.run([sys.executable, "-c", _MAPPED_CHUNKS], env=malloc_env(threshold), check=True,
                             capture_output=True, text=True).stdout
        return int(out)

    assert malloc_env(MMAP_THRESHOLD_MAX)["MALLOC_TRIM_THRESHOLD_"] == str(2 * MMAP_THRESHOLD_MAX)
    assert mapped(MMAP_THRESHOLD_MAX) == 0  # 16 MiB under a fixed 32 MiB threshold: from the heap
    assert mapped(1 << 20) == 1  # over a fixed 1 MiB threshold: mapped on its own
    assert mapped(None) == 1  # glibc's default starts at 128 KiB (the user's 32 MiB dropped)
    assert "MALLOC_MMAP_THRESHOLD_" not in malloc_env(None)


def test_measurements_run_two_at_a_time_wait_passively_unless_the_user_chose_a_policy(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    req = MeasureRequest(workload="tiny-mlp", batch_size=8, mode="trace", trace_path="t.npz")
    assert child_env(req, beside_another=True)["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in child_env(req)  # alone, as the user's run: libgomp's default
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert child_env(req, beside_another=True)["OMP_WAIT_POLICY"] == "ACTIVE"


def test_the_profiled_run_fixes_glibcs_mmap_threshold_and_the_others_keep_the_users():
    # the profiled run's heap grew with the batch under glibc's dynamic threshold (measure.PROFILED_MMAP_THRESHOLD)
    alloc = MeasureRequest(workload="tiny-mlp", batch_size=8, mode="alloc")
    assert child_env(alloc)["MALLOC_MMAP_THRESHOLD_"] == str(PROFILED_MMAP_THRESHOLD)
    assert child_env(alloc.model_copy(update={"mmap_threshold": 4 << 20}))["MALLOC_MMAP_THRESHOLD_"] == str(4 << 20)
    assert "MALLOC_MMAP_THRESHOLD_" not in child_env(MeasureRequest(workload="tiny-mlp", batch_size=8, mode="rss"))


def test_a_run_that_outgrows_its_memory_cap_fails_with_a_message_and_the_calibrations_runs_are_capped():
    # tiny-mlp at 200,000 samples takes ~1.1 GB over its baseline; under a 0.7 GB cap its allocation fails
    big = MeasureRequest(workload="tiny-mlp", batch_size=200_000, mode="rss", memory_cap_bytes=700_000_000)
    with pytest.raises(TrialError, match=r"outgrew its memory cap of 0\.70 GB .*allocate"):
        measure(big)
    available = available_bytes()
    assert available is not None and available > 0
    jobs = {b: MeasureRequest(workload="tiny-mlp", batch_size=b, mode="rss") for b in (4, 8)}
    done = _run_parallel(jobs)  # two at once: each capped at half of what this host has available
    for r in done.values():
        assert 0 < r.request.memory_cap_bytes <= available // 2 * 1.1 + 2**30, r.request.memory_cap_bytes
        assert r.rss_delta_bytes > 0  # and the runs themselves, far under it, went on

"""The resident-set peak a fresh measuring process reports is its own, whatever launched it."""

from __future__ import annotations

from advisor.measure import MeasureRequest, measure
from advisor.procmem import current_rss, mark_peak, peak_rss

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

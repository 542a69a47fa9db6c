"""CPU calibration: the second round of real runs near the predicted largest batch, against real runs."""

from __future__ import annotations

import re

from advisor.estimate import estimate_memory
from advisor.hardware import get_hardware

MB = 1_000_000


def test_largest_batch_is_resolved_again_near_itself() -> None:
    # Asked at batch 16, the first round runs at 2-8; the largest batch under 260 MB is ~250, so the
    # second round runs near 60 and 120 (cheap: a few hundred MB against this host's memory).
    cap = 260 * MB
    hw = get_hardware("cpu").model_copy(update={"host_memory_bytes": cap})
    est = estimate_memory("tiny-gpt2", hw, 16, calibrate=True, measured=False)  # default 5% margin
    again = [n for n in est.notes if "re-solved" in n]
    assert again, est.notes
    first, second = map(int, re.search(r": (\d+) -> (\d+)$", again[0]).groups())
    assert second == est.max_batch_size
    batches = {int(b) for b in re.search(r"batch sizes ([\d, ]+):", again[0]).group(1).split(", ")}
    assert {first // 4, first // 2} <= batches, again[0]  # the second round ran near the first answer
    # Whether the answer really fits under the cap is issue 2's largest-batch goal, measured by
    # bench/estimate_accuracy.py against a real bisection (not met for every workload yet, see
    # BENCHMARKS.md); a single real run here, with the resident set's 5-13% spread, cannot settle it.
    assert 0 < est.max_batch_size < first * 2


def test_no_second_round_when_the_cap_is_this_hosts_memory() -> None:
    # Half the largest batch would take about half the host: not cheap, so no second round.
    est = estimate_memory("tiny-mlp", "cpu", 64, calibrate=True, measured=False)
    assert est.calibrated
    assert not any("re-solved" in n for n in est.notes), est.notes

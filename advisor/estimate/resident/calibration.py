"""A CPU calibration: the resident-set line fitted on real runs, the runs, and how far the next run may stray."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from advisor.estimate.resident.overhead import CpuCalibration

# One resident-set run, or measured peak: (batch size, resident-set increase in bytes, the glibc mmap
# threshold it fixed (bytes; threshold.run_mmap_threshold), or None where glibc's dynamic default ran).
Run = tuple[int, int, int | None]

# The least noise assumed in one run's resident set, as a share of it: identical runs differ by 1-6%
# (vit-b16 1.631-1.642 GB, bert-base 2.190-2.220, gpt2-small 2.444-2.602, mlp 0.406-0.433).
# Evidence: bench/estimate_accuracy.py, bench/results/accuracy-fp32.json
RUN_NOISE = 0.02
# How far one run's resident set may lie below the median of three identical runs, as a share of that median:
# what the largest batch keeps clear at least (Calibration.noise_share). The 95th percentile over 224 cases of
# three runs each (median 1.0%, 90th percentile 4.2%, 95th 5.0%, largest 14%).
# Evidence: bench/research/run_noise.py, bench/results/**/accuracy*.json
UNREPEATED_NOISE = 0.05
# How far the median of three fresh runs may come out above the highest of k runs at one batch size, as a share
# of it, for k = 1, 2, 3 and more: what a batch whose own runs vouch for it keeps clear (Calibration.runs_share).
# At the percentile where one run's excess reaches UNREPEATED_NOISE (96-97th), two runs' reaches 2.1-2.53% and
# three runs' 1.5% (760 sets of three runs; pooled and per-case normal, the larger, rounded up).
# Evidence: bench/research/run_noise.py, bench/results/**/accuracy*.json
MAX_OF_RUNS_NOISE = (UNREPEATED_NOISE, 0.026, 0.015)
# A run's noise as a share of its resident set shrinks as the resident set grows: the 95th percentile of a run's
# shortfall below its set's median falls from 4.6% at 0.29 GB to 2.2% at 2.3 GB (a power law of exponent -0.33,
# 3.0% at 1 GB). The shares above hold up to NOISE_REF_BYTES and shrink as resident^-NOISE_EXPONENT past it; a
# range seen at one batch size shrinks the same way to a larger resident set (from NOISE_LAW_FROM where smaller:
# too few sets were measured below it to say) and never grows to a smaller one.
# Evidence: bench/research/run_noise.py --by-size, bench/results/**/accuracy*.json
NOISE_REF_BYTES = 1e9
NOISE_LAW_FROM = 0.25e9
NOISE_EXPONENT = 1 / 3


def noise_scale(seen: float, resident: float) -> float:
    """What a noise share seen at a resident set of `seen` bytes becomes at `resident` bytes (at most 1)."""
    seen = max(seen, NOISE_LAW_FROM)
    return 1.0 if resident <= seen else (seen / resident) ** NOISE_EXPONENT


@dataclass(frozen=True)
class Calibration(CpuCalibration):
    batches: tuple[int, ...] = ()
    used_real_traces: bool = False
    rss: tuple[Run, ...] = ()
    # (batch size, resident-set increase in bytes) that the runs' own allocations, rescaled to that batch and
    # replayed through glibc, put there (calibrate.replay_at_batch): one more run at the batch, for `at_batch`
    replayed: tuple[tuple[int, int], ...] = ()

    def margin(self, resident: float) -> float:
        """What the largest batch keeps clear of the cap at a batch whose resident set is predicted
        `resident` (bytes): the fit's spread, or `noise_share` of `resident` where wider. A fit through
        two points passes within bytes of both, yet the next run strays as far as runs do."""
        return max(self.spread, self.noise_share(resident) * resident) if self.rss else self.spread

    def noise_share(self, resident: float = 0.0) -> float:
        """How far a run at the answer may come out above the fit, as a share of its resident set
        `resident` (bytes): `runs_share` of one run, so at least UNREPEATED_NOISE, what single runs stray
        by across workloads, or the runs' own `repeat_noise` where wider. Two runs that agree say little
        of the next one."""
        return self.runs_share(1, resident)

    def runs_share(self, k: int, resident: float = 0.0) -> float:
        """What a batch whose own k runs (1 or more) vouch for it keeps clear above the highest of them,
        as a share of it, at a resident set of `resident` bytes: MAX_OF_RUNS_NOISE for k runs, or the runs'
        `repeat_noise` where wider, each as `noise_scale` takes it there."""
        share = MAX_OF_RUNS_NOISE[min(k, len(MAX_OF_RUNS_NOISE)) - 1] * noise_scale(NOISE_REF_BYTES, resident)
        return max(share, self.repeat_noise(resident))

    def repeat_noise(self, resident: float = 0.0) -> float:
        """How far two runs at one batch size under glibc's default differ, as a share of their median (0
        where no batch size ran more than once): each repeated batch size's standard deviation over its
        median, taken to a resident set of `resident` bytes (`noise_scale`), pooled over those batch sizes
        (each weighed by its runs less one), times sqrt(2) so that one pair gives its own range. Pooled, not
        the widest range: within a workload a run's noise, as a share, is one trait across batch sizes, and
        the widest of several ranges grows with how many batch sizes ran twice.
        Evidence: bench/research/range_law.py, bench/results/**/accuracy*.json"""
        num = den = 0.0
        for rs in self.default_runs().values():
            if len(rs) > 1:
                median = float(np.median(rs))
                share = float(np.std(rs, ddof=1)) / median * noise_scale(median, resident)
                num, den = num + (len(rs) - 1) * share ** 2, den + len(rs) - 1
        return math.sqrt(2 * num / den) if den else 0.0

    def default_runs(self) -> dict[int, list[int]]:
        """The resident-set runs under glibc's default allocator, as the user's run will be, by batch
        size (bytes): calibration runs, near rounds', measured peaks."""
        by_batch: dict[int, list[int]] = {}
        for b, resident, threshold in self.rss:
            if threshold is None:
                by_batch.setdefault(b, []).append(resident)
        return by_batch

    def runs_at(self, b: int) -> list[int]:
        """The resident-set increases of the runs at batch b itself under glibc's default allocator,
        as a user runs it (bytes): calibration runs at the batch, a near round's, measured peaks."""
        return self.default_runs().get(b, [])

    def at_batch(self, b: int, line: float) -> float:
        """The resident set at batch b (bytes): the fit's `line` there, drawn toward the mean of the runs
        at b itself by n / (n + 1) for n runs (the posterior mean where the fit's error at b and one run's
        noise are alike). The line alone cannot bend where the heap's reuse of freed chunks changes
        between the runs below b and b itself; a replay of the runs' heap at b (`replayed`) can, and
        counts as one run there."""
        rs = self.runs_at(b) + [r for x, r in self.replayed if x == b]
        if not rs:
            return line
        return line + len(rs) / (len(rs) + 1) * (float(np.mean(rs)) - line)

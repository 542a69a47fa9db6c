"""Measuring the leaders again before the tuner names its best.

One trial's throughput is one draw: on a CPU, two runs of one configuration differ by 2-18% (median over a
grid's configurations; bench/tune_bench.py, bench/results/tune-*.json), as much as the top few configurations of
a grid differ from each other. A search that ranks single draws names the luckiest of the close ones. So the last
trials of the budget (`TuneRequest.resolved_confirm`) measure the leader again, then the configurations whose
mean is within reach of the leader's (CONTENDER_BAND, or the spread the repeats show where wider), the least
measured first, and the study ranks configurations by the mean of their measurements.
"""

from __future__ import annotations

import statistics

from advisor.store.records import RecordStatus, TrialRecord
from advisor.trial import TrainingConfig

# a configuration whose mean is within this fraction of the leader's is a contender, at least: about the median
# difference between two runs of one configuration (bench/results/tune-*.json: 2-18%, median over configurations)
CONTENDER_BAND = 0.10
MAX_MEASUREMENTS = 3  # measurements of one configuration at most; more narrow its mean by little


def measured(records: list[TrialRecord], metric: str) -> dict[str, list[TrialRecord]]:
    """The study's ok measurements by configuration hash (each configuration's in the order taken)."""
    out: dict[str, list[TrialRecord]] = {}
    for r in sorted(records, key=lambda r: (r.attempt, r.id)):
        if r.status == RecordStatus.ok and getattr(r, metric):
            out.setdefault(r.config_hash, []).append(r)
    return out


def mean_value(records: list[TrialRecord], metric: str) -> float:
    """A configuration's value: the mean of its measurements of `metric`."""
    return statistics.fmean(getattr(r, metric) for r in records)


def spread(by_config: dict[str, list[TrialRecord]], metric: str) -> float:
    """How far two runs of one configuration fall apart here: the median over the configurations measured more
    than once of (highest - lowest) / mean; 0 where none is."""
    spans = [(max(v) - min(v)) / statistics.fmean(v) for rs in by_config.values() if len(rs) > 1
             for v in [[getattr(r, metric) for r in rs]]]
    return statistics.median(spans) if spans else 0.0


def next_repeat(records: list[TrialRecord], metric: str) -> TrainingConfig | None:
    """The configuration to measure once more: the leader (the best mean) while it has one measurement; then, of
    the contenders (a mean within CONTENDER_BAND of the leader's, or within the spread this study's repeats show
    where that is wider), the least measured (the higher mean on a tie), below MAX_MEASUREMENTS. None with fewer
    than two configurations, when the leader has no contender, or when the least measured contender has been
    measured MAX_MEASUREMENTS times."""
    by_config = measured(records, metric)
    if len(by_config) < 2:
        return None
    means = {h: mean_value(rs, metric) for h, rs in by_config.items()}
    leader = max(means, key=means.get)
    if len(by_config[leader]) == 1:
        return by_config[leader][-1].config
    band = max(CONTENDER_BAND, spread(by_config, metric))
    close = [h for h, m in means.items() if m >= (1 - band) * means[leader]]
    if len(close) < 2:
        return None  # nothing within reach: more runs of the leader would change no ranking
    pick = min(close, key=lambda h: (len(by_config[h]), -means[h]))
    if len(by_config[pick]) >= MAX_MEASUREMENTS:
        return None
    return by_config[pick][-1].config


__all__ = ["CONTENDER_BAND", "MAX_MEASUREMENTS", "mean_value", "measured", "next_repeat", "spread"]

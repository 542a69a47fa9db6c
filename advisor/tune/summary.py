"""What a tuning run ends with: the study's top configurations against the baseline, and counts."""

from __future__ import annotations

from collections import Counter
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from advisor.store.records import RecordStatus, TrialRecord
from advisor.trial import TrainingConfig


class RankedTrial(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    record: TrialRecord = Field(description="The configuration's latest ok measurement.")
    value: float = Field(description="The objective's first metric (samples/s or tokens/s), the mean of the "
                         "configuration's measurements.")
    measurements: int = Field(default=1, description="Times the study measured this configuration ok.")
    speedup: float | None = Field(default=None, description="value over the baseline's (x).")


class TuneSummary(BaseModel):
    """The study after this run: its trials by status, the best, the baseline, the top N."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    study_id: int
    study_name: str
    metric: str
    objective_key: str
    baseline: TrialRecord | None
    best: RankedTrial | None
    top: list[RankedTrial]
    pareto: list[RankedTrial] = Field(default_factory=list, description="Two objectives: the non-dominated trials.")
    statuses: dict[str, int] = Field(description="Trials of the study by status.")
    wall_s: float = Field(description="This run, start to end (s).")
    trial_s: float = Field(description="Sum of the wall times of the trials this run measured (s).")
    stats: dict[str, Any] = Field(default_factory=dict)


def _pareto(ok: list[TrialRecord], metric: str) -> list[TrialRecord]:
    """Trials no other beats on both throughput (higher) and peak memory (lower)."""
    def dominated(a: TrialRecord) -> bool:
        return any(getattr(b, metric) >= getattr(a, metric) and b.peak_memory_bytes <= a.peak_memory_bytes
                   and (getattr(b, metric) > getattr(a, metric) or b.peak_memory_bytes < a.peak_memory_bytes)
                   for b in ok)
    return sorted((a for a in ok if a.peak_memory_bytes is not None and not dominated(a)),
                  key=lambda r: -getattr(r, metric))


def summarize_study(store, study_id: int, baseline: TrainingConfig, ctx, stats: dict[str, Any], wall_s: float,
                    top_n: int = 10) -> TuneSummary:
    from advisor.store import config_hash
    from advisor.tune.confirm import mean_value, measured

    study = store.get_study(study_id)
    records = store.study_trials(study_id)
    metric = ctx.metric
    ok = [r for r in records if r.status == RecordStatus.ok and getattr(r, metric)]
    by_config = measured(ok, metric)  # a configuration measured more than once is ranked by its mean
    base = by_config.get(config_hash(baseline), [None])[-1]
    base_value = mean_value(by_config[base.config_hash], metric) if base else None

    def ranked(r: TrialRecord) -> RankedTrial:
        runs = by_config[r.config_hash]
        value = mean_value(runs, metric)
        return RankedTrial(record=r, value=value, measurements=len(runs),
                           speedup=value / base_value if base_value else None)

    top = sorted((ranked(runs[-1]) for runs in by_config.values()), key=lambda t: -t.value)[:top_n]
    pareto = [ranked(r) for r in _pareto([rs[-1] for rs in by_config.values()], metric)] \
        if len(ctx.objective.metrics) > 1 else []
    return TuneSummary(study_id=study_id, study_name=study.name, metric=metric, objective_key=ctx.objective.key,
                       baseline=base, best=top[0] if top else None, top=top, pareto=pareto,
                       statuses=dict(Counter(r.status.value for r in records)), wall_s=wall_s,
                       trial_s=stats.get("trial_s", 0.0),
                       stats=stats)

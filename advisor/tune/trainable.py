"""One tuner trial, inside a Ray worker or the tuner's own process (inline): claim the configuration, reuse or
prune it, or measure it for real, store the outcome, and report the objective (to Ray, and so to Optuna).

Nothing here may crash the study: a trial that fails is a stored result with its status.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from advisor.store.records import Objective, RecordStatus, TrialQuery, TrialRecord
from advisor.trial import TrainingConfig
from advisor.tune.request import TuneRequest

log = logging.getLogger(__name__)
MEMORY_PENALTY = 1e18  # bytes reported for a trial that measured nothing, in the two-objective search
_STORES: dict[str, Any] = {}  # one open store per database URL in each worker process


class StudyContext(BaseModel):
    """What every trial of one study shares; sent to the Ray workers as JSON."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    request: TuneRequest
    study_id: int
    workload_fp: str
    hardware_fp: str
    software_fp: str
    db_url: str
    objective: Objective
    owner: str = Field(description="host:pid of the tuner driver: claims are its, so they die with it (SIGKILL).")
    fork_server: str | None = Field(
        default=None, description="The socket path of the driver's fork server (trial ranks and isolation workers "
        "fork from it) for a local Ray's trials to fork through, so that an actor imports no torch before its first "
        "trial.")

    @property
    def metric(self) -> str:
        return self.objective.metrics[0].name


def _store(ctx: "StudyContext"):
    """The worker's store for this study's database; its claims carry the driver as their owner."""
    from advisor.store import open_store

    if ctx.db_url not in _STORES:
        _STORES[ctx.db_url] = open_store(ctx.db_url)
    store = _STORES[ctx.db_url]
    store.owner = ctx.owner
    return store


def metrics_of(rec: TrialRecord, ctx: StudyContext, *, reused: bool) -> dict[str, Any]:
    """What Ray reports for a stored trial: the objective(s), with penalties for no measurement."""
    ok = rec.status == RecordStatus.ok
    value = getattr(rec, ctx.metric) if ok else None
    out: dict[str, Any] = {"objective": float(value or 0.0), "status": rec.status.value, "record_id": rec.id,
                           "reused": reused, "samples_per_s": rec.samples_per_s or 0.0,
                           "trial_wall_s": rec.result.wall_s if rec.result is not None and not reused else 0.0}
    if len(ctx.objective.metrics) > 1:
        out["memory"] = float(rec.peak_memory_bytes) if ok and rec.peak_memory_bytes else MEMORY_PENALTY
    return out


def _wait_for(store, ctx: StudyContext, config_hash: str) -> TrialRecord | None:
    """The study's last attempt at this configuration, once no process is measuring it."""
    deadline = time.monotonic() + ctx.request.trial_budget.timeout_s + 120
    while True:
        found = store.query_trials(TrialQuery(study=ctx.study_id, config_hash=config_hash, sort="-attempt", limit=1))
        if found and found[0].status != RecordStatus.running or time.monotonic() > deadline:
            return found[0] if found else None
        time.sleep(1.0)


def _oom_block(store, ctx: StudyContext, config: TrainingConfig) -> str | None:
    """An OOM at batch b in this study rules out b and above with the same other knobs."""
    from search_spaces import OomFrontier

    frontier = OomFrontier()
    for rec in store.query_trials(TrialQuery(study=ctx.study_id, status=RecordStatus.oom)):
        frontier.record_oom(rec.config)
    return frontier.blocks(config)


class TunerGone(Exception):
    """The tuner whose trial this is ended while it was measured (killed): its claim is left running, for the next
    run to mark interrupted and measure again. The measurement is not kept: whatever ended the tuner, or the next
    run starting beside the trial, may have taken the CPU from it."""


def _measure(store, ctx: StudyContext, claim, config: TrainingConfig) -> tuple[TrialRecord, float]:
    """Prune by the OOM frontier and the estimate, else run the trial; store what happened. Returns the record and
    the seconds the estimate took."""
    from advisor.hardware import get_hardware
    from advisor.store.sql import owner_gone
    from probes.runner import run_trial
    from search_spaces import feasibility

    req = ctx.request
    blocked = _oom_block(store, ctx, config)
    if blocked:
        return store.prune_trial(claim, blocked), 0.0
    hw = get_hardware(req.hardware)
    # the estimate gets half the trial's time at most: a workload that hangs while traced is the trial's to measure
    t0 = time.monotonic()
    feas = feasibility(req.workload, req.workload_args, hw, config, req.margin, req.trial_budget.timeout_s / 2)
    estimate_s, estimate = time.monotonic() - t0, feas.model_dump(mode="json")
    if not feas.launch:
        return store.prune_trial(claim, feas.reason, estimate=estimate,
                                 predicted_memory_bytes=feas.total_bytes), estimate_s
    # the trial records the estimate its launch rests on; where that estimate failed (the workload raised, crashed
    # or hung while traced: its reason is stored), the trial does not spend its own time failing it again
    result = run_trial(req.workload, config, hardware=hw, workload_args=req.workload_args, budget=req.trial_budget,
                       prediction=feas.estimate, estimate=feas.estimate is not None)
    if owner_gone(ctx.owner):  # known for a tuner on this host only
        raise TunerGone(f"the tuner {ctx.owner} that claimed this trial ended while it ran")
    rec = store.finish_trial(claim, result, estimate=estimate)
    if result.ok:
        store.update_best(ctx.workload_fp, ctx.hardware_fp, ctx.objective, rec.id)
    return rec, estimate_s


def evaluate(ctx: StudyContext, config_json: str | None, *, repeat: bool = False) -> dict[str, Any]:
    """Claim, reuse, prune or measure one configuration; the metrics to report. `repeat`: measure once more a
    configuration the study has measured ok (a stored measurement the study does not hold yet is reused)."""
    from advisor.store import config_hash
    from advisor.store.base import measurement_key
    from advisor.trial import TrialResult, TrialStatus

    if config_json is None:  # the draw cannot reach the global batch size: nothing to run
        return _nothing(ctx, "invalid")
    config = TrainingConfig.model_validate_json(config_json)
    store, key = _store(ctx), config_hash(config)
    claim = store.claim_trial(ctx.study_id, config, repeat=repeat)
    if claim is None:  # measured in this study already, or being measured by another tuner
        rec = _wait_for(store, ctx, key)
        # a repeat within the study: not a new configuration, so the budget must not count it
        return {**metrics_of(rec, ctx, reused=True), "duplicate": True} if rec else _nothing(ctx, "error")
    held = {measurement_key(r) for r in store.query_trials(TrialQuery(study=ctx.study_id, config_hash=key))}
    prev = None if ctx.request.remeasure else store.find_measured(
        ctx.workload_fp, ctx.hardware_fp, ctx.software_fp, key, timeout_s=ctx.request.trial_budget.timeout_s,
        exclude=held)
    marks = {"repeat": True} if repeat else {}
    try:
        if prev is not None and prev.result is not None:
            rec = store.finish_trial(claim, prev.result, estimate=prev.estimate)
            if prev.status == RecordStatus.ok:
                store.update_best(ctx.workload_fp, ctx.hardware_fp, ctx.objective, rec.id)
            return {**metrics_of(rec, ctx, reused=True), **marks}
        rec, estimate_s = _measure(store, ctx, claim, config)
        return {**metrics_of(rec, ctx, reused=False), "estimate_s": estimate_s, **marks}
    except TunerGone:
        return _nothing(ctx, "interrupted")
    except Exception as exc:  # noqa: BLE001 - a bug of ours in one trial is that trial's error, not the study's end
        log.exception("trial failed inside the tuner")
        failed = TrialResult(status=TrialStatus.error, error=f"{type(exc).__name__}: {exc}",
                             workload=ctx.request.workload, hardware=ctx.request.hardware, config=config)
        return metrics_of(store.finish_trial(claim, failed), ctx, reused=False)


def _nothing(ctx: StudyContext, status: str) -> dict[str, Any]:
    """Metrics for a draw that measured nothing and left no stored row."""
    return {"objective": 0.0, "status": status, "record_id": None, "reused": False, "samples_per_s": 0.0,
            **({"memory": MEMORY_PENALTY} if len(ctx.objective.metrics) > 1 else {})}


def fork_server_address() -> str | None:
    """The socket path of this process's fork server (started now where it was not), which a trial's actor on this
    host forks through (StudyContext.fork_server); None where no other process can attach."""
    from advisor.isolation.pool import fork_server

    return fork_server().address


def inline_imports() -> None:
    """For a run whose trials `evaluate` runs in this process, called while the run's opening waits on the
    workload's isolated worker: the modules the opening and the first trial import next (the store, Alembic,
    Optuna's storage, the seeds, the runner, the pruning: a second of CPU) are imported now, so that neither waits
    on them."""
    import optuna.storages  # noqa: F401

    import advisor.store.migrate  # noqa: F401
    import advisor.store.sql  # noqa: F401
    import advisor.tune.seeds  # noqa: F401
    import probes.runner  # noqa: F401
    import search_spaces.prune  # noqa: F401


def ray_trainable(config: dict[str, Any], ctx_json: str) -> None:
    """The function Ray Tune runs for each trial. It forks through the driver's fork server where the context
    names it (a local Ray); where it starts its own (it imports torch: seconds), it starts at once in the
    background, so its start overlaps the claim, the reuse check and the estimate. An actor reused for the
    next trial (reuse_actors) keeps it."""
    from ray import tune

    from advisor.isolation.pool import default_pool, use_shared_server

    ctx = StudyContext.model_validate_json(ctx_json)
    if ctx.fork_server:
        use_shared_server(ctx.fork_server)
    default_pool().warm()  # the isolated worker that estimates each configuration, and the trial's ranks
    tune.report(evaluate(ctx, config.get("training_config"), repeat=bool(config.get("repeat"))))

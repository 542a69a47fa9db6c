"""The result store's interface: a few abstract operations, and the queries derived from them
written once here, so every backend behaves the same (one contract test runs against each)."""

from __future__ import annotations

import abc
from typing import Any

from advisor.store.records import (
    MAX_ATTEMPTS,
    MEASURED,
    BestRecord,
    Claim,
    Objective,
    RecordStatus,
    StudyRecord,
    StudySpec,
    TrialQuery,
    TrialRecord,
)
from advisor.trial import TrainingConfig, TrialResult


def outcome_columns(result: TrialResult) -> dict[str, Any]:
    """The queried figures of a TrialResult, as trial-row columns (units as in TrialResult)."""
    steps = result.step_time_s
    return {"status": RecordStatus(result.status.value), "samples_per_s": result.samples_per_s,
            "tokens_per_s": result.tokens_per_s, "step_p50_s": steps.p50 if steps else None,
            "step_p90_s": steps.p90 if steps else None, "peak_memory_bytes": result.peak_memory_bytes,
            "predicted_memory_bytes": result.predicted_memory_bytes, "data_wait_fraction": result.data_wait_fraction,
            "mfu": result.mfu, "bottleneck": result.bottleneck.verdict if result.bottleneck else None,
            "result": result.model_dump(mode="json"), "error": result.error}


def measurement_key(record: TrialRecord) -> tuple[Any, ...]:
    """What tells one measurement from another: a study reusing a stored measurement keeps a copy of its
    result, so copies share the key and separate runs (their wall times and rates) do not."""
    r = record.result
    return (record.status.value, r.wall_s, r.samples_per_s, r.tokens_per_s) if r is not None else ("none", record.id)


class ResultStore(abc.ABC):
    """Where studies and their trials are kept.

    Contract every implementation keeps:
    - `claim_trial` is atomic across processes: of concurrent claims of one configuration in one
      study, exactly one gets a Claim; a configuration is claimed again only after its last attempt
      was `interrupted`, and at most MAX_ATTEMPTS times in all, or, asked to `repeat`, after one that was `ok`.
    - `_finish` writes a claimed row once; figures never change after that.
    - `update_best` is atomic: concurrent updates leave the better trial on the objective's first metric.
    - Errors from the database are raised as StoreError with one line for the user.
    """

    # -- abstract: what a backend must provide --------------------------------------------------
    @abc.abstractmethod
    def create_or_get_study(self, spec: StudySpec) -> StudyRecord:
        """The study named spec.name, created (with its workload and hardware rows) when absent.
        StoreError when a study of that name exists for another workload, hardware or objective."""

    @abc.abstractmethod
    def get_study(self, name_or_id: str | int) -> StudyRecord | None: ...

    @abc.abstractmethod
    def finish_study(self, study_id: int, status: str = "finished") -> None: ...

    @abc.abstractmethod
    def claim_trial(self, study_id: int, config: TrainingConfig, *, repeat: bool = False) -> Claim | None:
        """Reserve `config` in the study for this process, or None when another process holds it,
        it was measured already, or it has used its attempts. With `repeat`, a configuration whose last
        attempt was measured ok is claimed for one more measurement (the next attempt)."""

    @abc.abstractmethod
    def _finish(self, claim: Claim, columns: dict[str, Any], estimate: dict[str, Any] | None) -> TrialRecord:
        """Write a claimed row's outcome (`columns` as from `outcome_columns`)."""

    @abc.abstractmethod
    def mark_interrupted(self, study_id: int, *, all_owners: bool = False) -> int:
        """Running rows of the study whose process is gone become `interrupted`; returns how many.
        A process is known gone when it ran on this host and its pid no longer exists; rows of
        other hosts change only with all_owners=True (the caller knows no other tuner is alive)."""

    @abc.abstractmethod
    def query_trials(self, query: TrialQuery) -> list[TrialRecord]: ...

    @abc.abstractmethod
    def update_best(self, workload_fp: str, hardware_fp: str, objective: Objective, trial_id: int) -> bool:
        """Make trial_id the best for (workload, hardware, objective) when none is stored or it is
        better on the objective's first metric; returns whether it is now the best."""

    @abc.abstractmethod
    def best(self, workload: str | None = None, hardware: str | None = None) -> list[BestRecord]: ...

    @abc.abstractmethod
    def workload_description(self, workload_fp: str) -> dict[str, Any] | None:
        """What the study's creator stored about the workload of this fingerprint (the tuner writes
        {"spec": ..., "args": ...}), or None when no workload of that fingerprint is stored."""

    @abc.abstractmethod
    def hardware_spec(self, hardware_fp: str) -> dict[str, Any] | None:
        """The HardwareSpec (as JSON) stored for this hardware fingerprint, or None when none is stored."""

    @abc.abstractmethod
    def close(self) -> None: ...

    # -- derived: written once for every backend ------------------------------------------------
    def finish_trial(self, claim: Claim, result: TrialResult, estimate: dict[str, Any] | None = None) -> TrialRecord:
        """Record a measured (or failed) trial's result against its claim."""
        return self._finish(claim, outcome_columns(result), estimate)

    def prune_trial(self, claim: Claim, reason: str, estimate: dict[str, Any] | None = None,
                    predicted_memory_bytes: int | None = None) -> TrialRecord:
        """Record a configuration not launched because its estimate did not fit."""
        columns = {"status": RecordStatus.pruned, "error": reason, "predicted_memory_bytes": predicted_memory_bytes}
        return self._finish(claim, columns, estimate)

    def get_trial(self, trial_id: int) -> TrialRecord | None:
        found = self.query_trials(TrialQuery(trial_id=trial_id))
        return found[0] if found else None

    def study_trials(self, study_id: int) -> list[TrialRecord]:
        return self.query_trials(TrialQuery(study=study_id))

    def find_measured(self, workload_fp: str, hardware_fp: str, software_fp: str, config_hash: str,
                      timeout_s: float | None = None,
                      exclude: set[tuple[Any, ...]] | None = None) -> TrialRecord | None:
        """The latest ok/oom trial of this configuration on this workload, hardware and software, in any
        study; with `timeout_s`, also a timeout that ran at least that long (so would time out again). Trials
        whose `measurement_key` is in `exclude` are passed over (a study measuring again takes another run's
        figures, never a copy of one it holds)."""
        statuses = MEASURED + ((RecordStatus.timeout,) if timeout_s is not None else ())
        found = self.query_trials(TrialQuery(workload=workload_fp, hardware=hardware_fp, software_fp=software_fp,
                                             config_hash=config_hash, status=statuses, sort="-finished_at",
                                             limit=1000 if exclude else 20))  # copies of what is excluded may lead
        return next((r for r in found if (r.status != RecordStatus.timeout or
                                          (timeout_s is not None and r.result is not None and
                                           r.result.wall_s >= timeout_s))
                     and measurement_key(r) not in (exclude or ())), None)

    def retries_due(self, study_id: int) -> list[TrialRecord]:
        """Interrupted trials whose configuration may run once more (its last attempt, with attempts left)."""
        last: dict[str, TrialRecord] = {}
        for t in self.study_trials(study_id):
            if t.config_hash not in last or t.attempt > last[t.config_hash].attempt:
                last[t.config_hash] = t
        return [t for t in last.values() if t.status == RecordStatus.interrupted and t.attempt < MAX_ATTEMPTS]

    def __enter__(self) -> "ResultStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The ResultStore contract, run against SQLite and PostgreSQL (the `db_url` fixture): studies,
atomic claims across real processes, finishing, interruption and one retry, reuse, queries, best."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
from store_data import THROUGHPUT, config, result, spec

from advisor.errors import StoreError
from advisor.store import Objective, RecordStatus, TrialQuery, config_hash, open_store, software_fingerprint
from advisor.trial import TrialStatus


@pytest.fixture
def store(db_url):
    with open_store(db_url) as s:
        yield s


def test_study_is_created_once_and_checked_on_reuse(store):
    first = store.create_or_get_study(spec())
    again = store.create_or_get_study(spec())
    assert again.id == first.id and again.objective == THROUGHPUT and again.status == "running"
    assert first.software_fp == software_fingerprint() and first.space == {"batch_size": [2, 4, 8]}
    with pytest.raises(StoreError, match="another workload"):
        store.create_or_get_study(spec(workload="resnet-tiny"))
    store.finish_study(first.id)
    done = store.get_study("study-a")
    assert done.status == "finished" and done.finished_at is not None
    assert store.get_study(str(first.id)).name == "study-a"


def test_claim_finish_and_no_second_claim(store):
    study = store.create_or_get_study(spec())
    claim = store.claim_trial(study.id, config(4))
    assert claim is not None and claim.attempt == 1 and claim.config_hash == config_hash(config(4))
    assert store.claim_trial(study.id, config(4)) is None  # running: held by us
    rec = store.finish_trial(claim, result(config(4), samples_per_s=200.0))
    assert rec.status == RecordStatus.ok and rec.samples_per_s == 200.0 and rec.tokens_per_s == 6400.0
    assert rec.step_p50_s == pytest.approx(0.02) and rec.peak_memory_bytes == 300 << 20
    assert rec.bottleneck == "compute-bound" and rec.result.config == config(4) and rec.mfu == 0.08
    assert store.claim_trial(study.id, config(4)) is None  # measured
    with pytest.raises(StoreError, match="not open"):
        store.finish_trial(claim, result(config(4)))  # figures never change once written
    pruned = store.prune_trial(store.claim_trial(study.id, config(64)), "estimate 90 GiB > 60 GiB usable",
                               estimate={"total_bytes": 90 << 30}, predicted_memory_bytes=90 << 30)
    assert pruned.status == RecordStatus.pruned and pruned.estimate == {"total_bytes": 90 << 30}
    assert pruned.error.startswith("estimate 90 GiB")


def _claim_all(url: str, configs: list, study_id: int, barrier, queue) -> None:
    with open_store(url) as s:  # its own engine and connections
        barrier.wait(timeout=60)
        won = [c.batch_size for c in configs if s.claim_trial(study_id, c) is not None]
    queue.put((os.getpid(), won))


def test_two_processes_claiming_the_same_configs_never_both_win(store, db_url):
    study = store.create_or_get_study(spec())
    configs = [config(b) for b in range(1, 25)]
    ctx = mp.get_context("fork")
    barrier, queue = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_claim_all, args=(db_url, configs, study.id, barrier, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    wins = [queue.get(timeout=120)[1] for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    claimed = [b for won in wins for b in won]
    assert sorted(claimed) == list(range(1, 25))  # every config claimed exactly once, by one process
    rows = store.study_trials(study.id)
    assert len(rows) == 24 and {r.status for r in rows} == {RecordStatus.running}


def _claim_and_die(url: str, study_id: int, batch_size: int) -> None:
    with open_store(url) as s:
        assert s.claim_trial(study_id, config(batch_size)) is not None
    os._exit(0)  # ends without finishing: as if killed mid-trial


def _run_child(target, *args) -> None:
    p = mp.get_context("fork").Process(target=target, args=args)
    p.start()
    p.join(timeout=60)
    assert p.exitcode == 0


def test_dead_claims_become_interrupted_and_are_retried_once(store, db_url):
    study = store.create_or_get_study(spec())
    mine = store.claim_trial(study.id, config(2))  # a live process's claim is left alone
    _run_child(_claim_and_die, db_url, study.id, 8)
    assert store.claim_trial(study.id, config(8)) is None  # still `running` until marked
    assert store.mark_interrupted(study.id) == 1
    statuses = {t.config.batch_size: t.status for t in store.study_trials(study.id)}
    assert statuses == {2: RecordStatus.running, 8: RecordStatus.interrupted}
    assert [t.config.batch_size for t in store.retries_due(study.id)] == [8]
    _run_child(_claim_and_die, db_url, study.id, 8)  # the retry, interrupted too
    assert store.mark_interrupted(study.id) == 1
    assert store.retries_due(study.id) == [] and store.claim_trial(study.id, config(8)) is None
    attempts = sorted(t.attempt for t in store.study_trials(study.id) if t.config.batch_size == 8)
    assert attempts == [1, 2]
    assert store.mark_interrupted(study.id, all_owners=True) == 0  # our own claim is never marked
    assert store.finish_trial(mine, result(config(2))).status == RecordStatus.ok


def test_reuse_finds_measured_configs_across_studies_only_on_same_keys(store):
    a = store.create_or_get_study(spec("a"))
    for cfg, status in ((config(4), TrialStatus.ok), (config(8), TrialStatus.oom), (config(16), TrialStatus.crashed)):
        store.finish_trial(store.claim_trial(a.id, cfg), result(cfg, status))
    b = store.create_or_get_study(spec("b"))
    found = store.find_measured(b.workload_fp, b.hardware_fp, b.software_fp, config_hash(config(4)))
    assert found is not None and found.study_name == "a" and found.samples_per_s == 120.0
    assert store.find_measured(b.workload_fp, b.hardware_fp, b.software_fp, config_hash(config(8))).status == "oom"
    # a crash: run again
    assert store.find_measured(b.workload_fp, b.hardware_fp, b.software_fp, config_hash(config(16))) is None
    assert store.find_measured(b.workload_fp, b.hardware_fp, "0" * 64, config_hash(config(4))) is None
    other_hw = store.create_or_get_study(spec("c", hardware="h100-sxm"))
    assert store.find_measured(b.workload_fp, other_hw.hardware_fp, b.software_fp, config_hash(config(4))) is None
    store.claim_trial(b.id, config(32))
    assert store.find_measured(b.workload_fp, b.hardware_fp, b.software_fp, config_hash(config(32))) is None


def test_a_timeout_is_reused_only_by_a_study_that_would_not_wait_longer(store):
    a = store.create_or_get_study(spec("a"))
    slow = config(64)
    timed_out = result(slow, TrialStatus.timeout).model_copy(update={"wall_s": 300.5})
    store.finish_trial(store.claim_trial(a.id, slow), timed_out)
    b = store.create_or_get_study(spec("b"))
    key = (b.workload_fp, b.hardware_fp, b.software_fp, config_hash(slow))
    assert store.find_measured(*key) is None  # callers that do not say their timeout rerun it
    assert store.find_measured(*key, timeout_s=300.0).status == "timeout"  # it would time out again
    assert store.find_measured(*key, timeout_s=600.0) is None  # a longer limit might see it finish


def _fill(store) -> dict[str, int]:
    """Two workloads on two hardware targets; returns trial ids by label."""
    ids = {}
    a = store.create_or_get_study(spec("gpt-cpu"))
    r = store.create_or_get_study(spec("resnet-h100", workload="resnet-tiny", hardware="h100-sxm"))
    for label, study, cfg, status, sps in (("g4", a, config(4), TrialStatus.ok, 100.0),
                                           ("g8", a, config(8), TrialStatus.ok, 300.0),
                                           ("g16", a, config(16), TrialStatus.oom, None),
                                           ("r4", r, config(4), TrialStatus.ok, 200.0),
                                           ("r8", r, config(8), TrialStatus.timeout, None)):
        ids[label] = store.finish_trial(store.claim_trial(study.id, cfg), result(cfg, status, sps)).id
    return ids


def test_query_filters_sorting_and_paging(store):
    ids = _fill(store)

    def q(**kw) -> list[int]:
        return [t.id for t in store.query_trials(TrialQuery(**kw))]

    assert q() == sorted(ids.values())
    assert q(workload="tiny-gpt2") == [ids["g4"], ids["g8"], ids["g16"]]
    assert q(workload="resnet-tiny", status="ok") == [ids["r4"]]
    assert q(hardware="h100-sxm") == [ids["r4"], ids["r8"]]
    hw_fp = store.get_study("resnet-h100").hardware_fp
    assert q(hardware=hw_fp[:10]) == q(hardware=hw_fp) == [ids["r4"], ids["r8"]]
    assert q(study="gpt-cpu", status=("oom", "timeout")) == [ids["g16"]]
    assert q(study=store.get_study("resnet-h100").id) == [ids["r4"], ids["r8"]]
    # descending by throughput; trials without the figure come last either way
    assert q(sort="-samples_per_s") == [ids["g8"], ids["r4"], ids["g4"], ids["g16"], ids["r8"]]
    assert q(sort="samples_per_s")[:3] == [ids["g4"], ids["r4"], ids["g8"]]
    assert q(sort="-samples_per_s", limit=2, offset=1) == [ids["r4"], ids["g4"]]
    assert q(workload="no-such-workload") == []


def test_best_keeps_the_better_trial_per_objective(store):
    ids = _fill(store)
    study = store.get_study("gpt-cpu")
    assert store.update_best(study.workload_fp, study.hardware_fp, THROUGHPUT, ids["g4"]) is True
    assert store.update_best(study.workload_fp, study.hardware_fp, THROUGHPUT, ids["g8"]) is True  # 300 > 100
    assert store.update_best(study.workload_fp, study.hardware_fp, THROUGHPUT, ids["g4"]) is False
    assert store.update_best(study.workload_fp, study.hardware_fp, THROUGHPUT, ids["g16"]) is False  # oom
    memory = Objective.parse("peak_memory_bytes:minimize")
    store.update_best(study.workload_fp, study.hardware_fp, memory, ids["g8"])
    best = {b.objective: b.trial.id for b in store.best(workload="tiny-gpt2")}
    assert best == {THROUGHPUT.key: ids["g8"], memory.key: ids["g8"]}
    assert store.best(hardware="h100-sxm") == []


def test_workload_description_and_hardware_spec_by_fingerprint(store):
    from advisor.hardware import HardwareSpec, get_hardware

    study = store.create_or_get_study(spec())
    assert store.workload_description(study.workload_fp) == {"params": 1234}
    assert HardwareSpec.model_validate(store.hardware_spec(study.hardware_fp)) == get_hardware("cpu")
    assert store.workload_description("f" * 32) is None and store.hardware_spec("f" * 64) is None

"""Measuring a configuration again, on SQLite and PostgreSQL: a study claims one more attempt of a configuration
it measured ok, reuses another study's measurement it does not hold yet (never a copy of its own), picks which
leader to measure again, and ranks configurations by the mean of their measurements."""

from __future__ import annotations

import pytest
from store_data import THROUGHPUT, config, result, spec

from advisor.store import config_hash, open_store
from advisor.store.base import measurement_key
from advisor.tune.confirm import MAX_MEASUREMENTS, measured, next_repeat, spread
from advisor.tune.request import TuneRequest
from advisor.tune.summary import summarize_study
from advisor.tune.trainable import StudyContext


@pytest.fixture
def store(db_url):
    with open_store(db_url) as s:
        yield s


def _measure(store, study_id: int, cfg, sps: float, wall_s: float = 5.0, repeat: bool = False):
    claim = store.claim_trial(study_id, cfg, repeat=repeat)
    assert claim is not None
    return store.finish_trial(claim, result(cfg, samples_per_s=sps).model_copy(update={"wall_s": wall_s}))


def test_a_repeat_claims_the_next_attempt_only_after_an_ok_measurement(store):
    study = store.create_or_get_study(spec())
    first = _measure(store, study.id, config(4), 100.0)
    assert store.claim_trial(study.id, config(4)) is None  # measured: a plain claim is refused
    again = _measure(store, study.id, config(4), 90.0, wall_s=6.0, repeat=True)
    assert (first.attempt, again.attempt) == (1, 2)
    store.claim_trial(study.id, config(8))  # running: not measured ok, so no repeat of it
    assert store.claim_trial(study.id, config(8), repeat=True) is None


def test_reuse_for_a_repeat_passes_over_the_measurements_the_study_holds(store):
    grid = store.create_or_get_study(spec("grid"))
    older = _measure(store, grid.id, config(4), 100.0, wall_s=5.0)
    second = store.create_or_get_study(spec("grid-2"))
    newer = _measure(store, second.id, config(4), 80.0, wall_s=5.5)
    tuned = store.create_or_get_study(spec("tuned"))
    key = (tuned.workload_fp, tuned.hardware_fp, tuned.software_fp, config_hash(config(4)))
    assert store.find_measured(*key).id == newer.id
    # the study took a copy of the newer one: measuring again, it gets the older run, then nothing
    copy = store.finish_trial(store.claim_trial(tuned.id, config(4)), newer.result)
    assert measurement_key(copy) == measurement_key(newer) != measurement_key(older)
    assert store.find_measured(*key, exclude={measurement_key(copy)}).id == older.id
    assert store.find_measured(*key, exclude={measurement_key(newer), measurement_key(older)}) is None


def test_the_leaders_are_measured_again_the_least_measured_first_and_ranked_by_their_mean(store):
    study = store.create_or_get_study(spec())
    _measure(store, study.id, config(2), 50.0)  # far behind: never a contender
    _measure(store, study.id, config(4), 100.0)
    _measure(store, study.id, config(8), 95.0)
    records = store.study_trials(study.id)
    assert next_repeat(records, "samples_per_s").batch_size == 4  # equally measured: the higher first
    _measure(store, study.id, config(4), 84.0, wall_s=6.0, repeat=True)  # the lucky one: mean 92
    assert next_repeat(store.study_trials(study.id), "samples_per_s").batch_size == 8
    _measure(store, study.id, config(8), 97.0, wall_s=6.0, repeat=True)  # mean 96
    ctx = StudyContext(request=TuneRequest(workload="tiny-gpt2", hardware="cpu"), study_id=study.id,
                       workload_fp=study.workload_fp, hardware_fp=study.hardware_fp, software_fp=study.software_fp,
                       db_url=store.url, objective=THROUGHPUT, owner=store.owner)
    summary = summarize_study(store, study.id, config(2), ctx, {}, 1.0)
    assert [(t.record.config.batch_size, t.value, t.measurements) for t in summary.top] == \
        [(8, 96.0, 2), (4, 92.0, 2), (2, 50.0, 1)]
    assert summary.best.speedup == pytest.approx(96.0 / 50.0)
    for n in range(2, MAX_MEASUREMENTS):  # measured as often as allowed: nothing left to settle
        _measure(store, study.id, config(4), 92.0, wall_s=6.0 + n, repeat=True)
        _measure(store, study.id, config(8), 96.0, wall_s=6.0 + n, repeat=True)
    assert next_repeat(store.study_trials(study.id), "samples_per_s") is None


def test_the_leader_is_measured_again_first_then_only_what_is_within_reach(store):
    study = store.create_or_get_study(spec())
    _measure(store, study.id, config(4), 100.0)
    assert next_repeat(store.study_trials(study.id), "samples_per_s") is None  # one configuration
    _measure(store, study.id, config(8), 80.0)  # more than CONTENDER_BAND behind
    assert next_repeat(store.study_trials(study.id), "samples_per_s").batch_size == 4  # a single run leads
    _measure(store, study.id, config(4), 99.0, wall_s=6.0, repeat=True)
    assert next_repeat(store.study_trials(study.id), "samples_per_s") is None  # its runs agree: 80 is out of reach


def test_contenders_are_those_within_the_spread_the_repeats_show(store):
    """Two runs of the leader 40% apart: a configuration 30% behind its mean is within reach."""
    study = store.create_or_get_study(spec())
    _measure(store, study.id, config(4), 120.0)
    _measure(store, study.id, config(8), 70.0)
    _measure(store, study.id, config(4), 80.0, wall_s=6.0, repeat=True)  # mean 100, spread 0.4
    records = store.study_trials(study.id)
    assert spread(measured(records, "samples_per_s"), "samples_per_s") == pytest.approx(0.4)
    assert next_repeat(records, "samples_per_s").batch_size == 8

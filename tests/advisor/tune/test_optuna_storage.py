"""Optuna's tables in our database, opened by the tuner (advisor.tune.driver._optuna_storage)."""

from __future__ import annotations

import optuna
import pytest
import sqlalchemy as sa

from advisor.tune.driver import _optuna_storage


def _torn(url: str) -> None:
    """The schema a first open of Optuna's storage leaves when its process is killed between CREATE TABLE
    studies and CREATE UNIQUE INDEX ix_studies_study_name (SQLite commits each DDL statement on its own; a
    job's process dies with its worker): built here by dropping the index after a whole first open."""
    engine = optuna.storages.RDBStorage(url).engine
    with engine.begin() as conn:
        conn.execute(sa.text("DROP INDEX ix_studies_study_name"))
    engine.dispose()


def test_a_schema_torn_between_its_ddl_statements_is_completed_on_open(tmp_path) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # Optuna's own open leaves it torn: each create_study(load_if_exists=True) adds a study of the same name,
    # and looking the name up then fails (MultipleResultsFound, as a restarted tune job would).
    bare = f"sqlite:///{tmp_path / 'bare.db'}"
    _torn(bare)
    storage = optuna.storages.RDBStorage(bare)
    optuna.create_study(storage=storage, study_name="s", load_if_exists=True)
    with pytest.raises(optuna.exceptions.StorageInternalError):
        optuna.create_study(storage=storage, study_name="s", load_if_exists=True)
    assert len(storage.get_all_studies()) == 2
    # The tuner's open creates the missing index: the second create_study loads the first's study.
    url = f"sqlite:///{tmp_path / 'store.db'}"
    _torn(url)
    storage = _optuna_storage(url)
    for _ in range(2):
        optuna.create_study(storage=storage, study_name="s", load_if_exists=True)
    assert [s.study_name for s in storage.get_all_studies()] == ["s"]
    assert optuna.load_study(study_name="s", storage=storage).study_name == "s"
    assert "ix_studies_study_name" in {i["name"] for i in sa.inspect(storage.engine).get_indexes("studies")}


def test_a_torn_store_that_already_holds_a_study_twice_keeps_both_and_the_busier_keeps_the_name(tmp_path) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = f"sqlite:///{tmp_path / 'store.db'}"
    _torn(url)
    storage = optuna.storages.RDBStorage(url)  # Optuna's own open: a torn store in use
    first = optuna.create_study(storage=storage, study_name="s", load_if_exists=True)
    first.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    with pytest.raises(optuna.exceptions.StorageInternalError):  # adds the second study, then fails its lookup
        optuna.create_study(storage=storage, study_name="s", load_if_exists=True)
    studies = storage.get_all_studies()
    assert [s.study_name for s in studies] == ["s", "s"]
    busier = studies[1]._study_id
    for _ in range(3):  # trials of the second study, written straight to the store as a tuner would have
        trial_id = storage.create_new_trial(busier)
        storage.set_trial_state_values(trial_id, optuna.trial.TrialState.COMPLETE, [0.5])
    storage.engine.dispose()
    # The index could not go on with two rows of one name: the tuner's open tells them apart first.
    storage = _optuna_storage(url)
    assert "ix_studies_study_name" in {i["name"] for i in sa.inspect(storage.engine).get_indexes("studies")}
    by_name = {s.study_name: s._study_id for s in storage.get_all_studies()}
    assert by_name == {"s": busier, f"s~duplicate-{studies[0]._study_id}": studies[0]._study_id}
    assert len(optuna.load_study(study_name="s", storage=storage).trials) == 3
    assert len(storage.get_all_trials(studies[0]._study_id)) == 1  # nothing lost
    optuna.create_study(storage=storage, study_name="s", load_if_exists=True)  # loads it, adds none
    assert len(storage.get_all_studies()) == 2

"""The schema ships as Alembic migrations: from an empty database to head matches the models exactly,
down to nothing and back, a revision this advisor does not know is refused, and Optuna's RDB storage
shares the database in either order of creation. Both backends (`db_url`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import inspect, text
from store_data import config, result, spec

from advisor.errors import StoreError
from advisor.store import open_store
from advisor.store.engine import make_engine, resolve_url
from advisor.store.migrate import VERSION_TABLE, current_revision, downgrade, head_revision, include_name, upgrade
from advisor.store.models import Base

OURS = set(Base.metadata.tables)


def schema_diff(url: str) -> list:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(resolve_url(url))
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"include_name": include_name, "version_table": VERSION_TABLE,
                                                     "compare_type": True})
        diff = compare_metadata(ctx, Base.metadata)
    engine.dispose()
    return diff


def tables(url: str) -> set[str]:
    engine = make_engine(resolve_url(url))
    names = set(inspect(engine).get_table_names())
    engine.dispose()
    return names


def test_upgrade_from_empty_matches_the_models(db_url):
    engine = make_engine(resolve_url(db_url))
    assert upgrade(engine) == head_revision() == "0002"
    engine.dispose()
    assert OURS | {VERSION_TABLE} <= tables(db_url)
    assert schema_diff(db_url) == []


def test_downgrade_to_nothing_and_back(db_url):
    engine = make_engine(resolve_url(db_url))
    upgrade(engine)
    downgrade(engine, "base")
    assert not OURS & tables(db_url)
    assert upgrade(engine) == head_revision()
    engine.dispose()
    assert schema_diff(db_url) == []


def test_store_creates_its_schema_on_first_use_and_refuses_unknown_revisions(db_url):
    assert not OURS & tables(db_url)
    with open_store(db_url) as store:
        assert store.create_or_get_study(spec()).id == 1
    engine = make_engine(resolve_url(db_url))
    with engine.begin() as conn:
        assert current_revision(conn) == head_revision()
        conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = 'ffff'"))
    engine.dispose()
    with pytest.raises(StoreError, match="unknown to this advisor"):
        open_store(db_url)


def _optuna_study(url: str, name: str):  # noqa: ANN202
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if url.startswith("sqlite:///"):  # Optuna does not create the file's directory
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    storage = optuna.storages.RDBStorage(resolve_url(url))
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize", load_if_exists=True)
    study.add_trial(optuna.trial.create_trial(params={"batch_size": 8},
                                              distributions={"batch_size": optuna.distributions.IntDistribution(1, 64)},
                                              value=123.0))
    return study


def test_optuna_first_then_our_upgrade(db_url):
    _optuna_study(db_url, "tune-a")
    optuna_tables = tables(db_url) - OURS
    assert {"studies", "trials", "alembic_version"} <= optuna_tables
    with open_store(db_url) as store:
        store.finish_trial(store.claim_trial(store.create_or_get_study(spec()).id, config(8)), result(config(8)))
    assert tables(db_url) >= optuna_tables | OURS  # Optuna's tables left in place
    assert schema_diff(db_url) == []
    import optuna

    loaded = optuna.load_study(study_name="tune-a", storage=resolve_url(db_url))
    assert loaded.best_value == 123.0


def test_our_store_first_then_optuna(db_url):
    with open_store(db_url) as store:
        study = store.create_or_get_study(spec())
    assert _optuna_study(db_url, study.optuna_study_name).best_trial.params == {"batch_size": 8}
    assert schema_diff(db_url) == []
    engine = make_engine(resolve_url(db_url))
    with engine.connect() as conn:
        assert current_revision(conn) == head_revision()  # Optuna's alembic_version is not ours
    engine.dispose()
    with open_store(db_url) as store:
        assert store.get_study(study.id).name == "study-a"


def _together(target, args: list[tuple]) -> list[int | None]:
    """Run `target(*a, barrier)` in one forked process per `a`, all released at once by a shared
    barrier; their exit codes. None outlives this call, even where one fails and strands the rest."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(len(args))
    procs = [ctx.Process(target=target, args=(*a, barrier)) for a in args]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [p.exitcode for p in procs]


def _open_and_create(url: str, name: str, barrier) -> None:
    barrier.wait(timeout=60)
    with open_store(url) as store:
        store.create_or_get_study(spec(name))


def test_processes_opening_an_empty_database_together_all_succeed(db_url):
    assert _together(_open_and_create, [(db_url, f"s{i}") for i in range(3)]) == [0, 0, 0]
    assert schema_diff(db_url) == []
    with open_store(db_url) as store:
        assert all(store.get_study(f"s{i}") is not None for i in range(3))


def _open_both(url: str, barrier) -> None:
    import optuna

    from advisor.tune.driver import _optuna_storage

    barrier.wait(timeout=60)
    with open_store(url) as store:
        name = store.create_or_get_study(spec()).optuna_study_name
    barrier.wait(timeout=60)  # every process reaches Optuna's first open together, as tuners started together do
    optuna.create_study(storage=_optuna_storage(resolve_url(url)), study_name=name, load_if_exists=True)


def test_tuners_opening_optuna_storage_on_a_new_database_together_all_succeed(db_url):
    assert _together(_open_both, [(db_url,)] * 4) == [0, 0, 0, 0]
    assert {"studies", "trials", "alembic_version"} <= tables(db_url)


def test_a_store_of_the_previous_revision_is_refused_then_upgraded_with_its_data(db_url):
    engine = make_engine(resolve_url(db_url))
    assert upgrade(engine, "0001") == "0001"  # a store written before the service's job queue
    engine.dispose()
    assert "advisor_jobs" not in tables(db_url)
    engine = make_engine(resolve_url(db_url))
    with engine.begin() as conn:  # a study and a trial, as the 0001 advisor wrote them
        conn.execute(text("INSERT INTO advisor_workloads (fingerprint, name, description, created_at) "
                          "VALUES ('w', 'tiny-gpt2', '{}', '2026-01-01')"))
        conn.execute(text("INSERT INTO advisor_hardware (fingerprint, name, spec, created_at) "
                          "VALUES ('h', 'cpu', '{}', '2026-01-01')"))
        conn.execute(text("INSERT INTO advisor_studies (name, workload_fp, hardware_fp, space, objective, software, "
                          "software_fp, optuna_study_name, status, created_at) VALUES ('old', 'w', 'h', '{}', "
                          "'{\"metrics\": [{\"name\": \"samples_per_s\", \"direction\": \"maximize\"}]}', '{}', 's', "
                          "'old', 'finished', '2026-01-01')"))
    with pytest.raises(StoreError, match="advisor db upgrade"):
        open_store(db_url)
    assert upgrade(engine) == head_revision() == "0002"
    engine.dispose()
    assert schema_diff(db_url) == []
    with open_store(db_url) as store:
        assert store.get_study("old").workload_name == "tiny-gpt2"
        from advisor.store.jobs import JobQueue

        assert JobQueue(store).submit({"workload": "tiny-gpt2"}, 1).status == "queued"

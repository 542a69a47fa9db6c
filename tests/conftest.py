"""Shared fixtures. The database under test: a SQLite file, and (where ADVISOR_TEST_POSTGRES_URL names a server) a fresh
PostgreSQL database with a random name, dropped afterwards. An unreachable server fails the test."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

# Each test process (each xdist worker under `make test`) gets a data dir of its own: the store,
# measured peaks, trial scratch, Ray's temp dir and the inductor cache are shared by that process's
# tests (a worker takes whole files) and by nothing else (not a user's data dir,
# not an earlier run, whose measured peaks would refine the estimates under test). Set before any
# test reads the settings; short, because Ray's socket paths live under it.
_DATA_DIR = tempfile.mkdtemp(prefix="advtest-")
os.environ["ADVISOR_DATA_DIR"] = _DATA_DIR


def pytest_sessionfinish(session, exitstatus):  # noqa: ANN001, ARG001 - pytest's hook
    shutil.rmtree(_DATA_DIR, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test():
    """A multiprocessing child left running by a test (one that failed and stranded the rest at a
    barrier, say) is killed here and the test errors: otherwise the interpreter waits for it at exit
    and the whole run hangs."""
    import multiprocessing as mp

    yield
    left = mp.active_children()
    for p in left:
        p.kill()
        p.join(10)
    if left:
        pytest.fail(f"the test left {len(left)} child process(es) running: {[p.name for p in left]}; killed")


PG_ENV = "ADVISOR_TEST_POSTGRES_URL"


def _pg_admin(server_url: str):  # noqa: ANN202
    import psycopg

    dsn = server_url.replace("postgresql+psycopg://", "postgresql://")
    try:
        return psycopg.connect(dsn, autocommit=True, connect_timeout=10)
    except psycopg.OperationalError as exc:
        pytest.fail(f"{PG_ENV}={server_url} is set but the server cannot be reached: {exc}")


@pytest.fixture
def postgresql_url() -> str:
    server = os.environ.get(PG_ENV)
    if not server:
        pytest.skip(f"{PG_ENV} is not set; set it (e.g. postgresql://postgres@127.0.0.1:5432/postgres) to run "
                    f"the PostgreSQL half of these tests")
    from sqlalchemy.engine import make_url

    name = f"advisor_test_{uuid.uuid4().hex[:12]}"
    with _pg_admin(server) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    yield make_url(server.replace("postgresql://", "postgresql+psycopg://", 1)).set(database=name) \
        .render_as_string(hide_password=False)
    with _pg_admin(server) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store' / 'advisor.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(f"{request.param}_url")

"""Alembic, driven in code (no alembic.ini): upgrade, current revision, and the schema check the
store runs on first use. Our version table is `advisor_alembic_version`: Optuna's RDB storage in the
same database keeps its own `alembic_version`, and each side ignores the other's tables."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from advisor.errors import StoreError

if TYPE_CHECKING:
    from alembic.config import Config
    from sqlalchemy.engine import Connection, Engine

VERSION_TABLE = "advisor_alembic_version"
SCRIPTS = Path(__file__).resolve().parent / "migrations"
_LOCK_KEY = 0x616476697372  # pg_advisory_lock key: "advisr", one upgrade at a time per server


def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    """Alembic sees only our tables: Optuna's (and anyone else's) are not ours to create or drop."""
    if type_ != "table":
        return True
    from advisor.store.models import Base

    return name in Base.metadata.tables


def alembic_config(connection: "Connection | None" = None, url: str | None = None) -> "Config":
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(SCRIPTS))
    if url:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "the package ships at least one migration"
    return head


def current_revision(connection: "Connection") -> str | None:
    from alembic.runtime.migration import MigrationContext

    return MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE}).get_current_revision()


@contextlib.contextmanager
def _migration_lock(conn: "Connection") -> Iterator[None]:
    """One migrating process at a time: a PostgreSQL advisory lock, or for a SQLite file an flock on
    `<file>-migrate.lock` beside it (never on the database file: closing another descriptor of it
    would drop SQLite's own locks)."""
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(f"SELECT pg_advisory_lock({_LOCK_KEY})")
        conn.commit()
        try:
            yield
        finally:
            conn.exec_driver_sql(f"SELECT pg_advisory_unlock({_LOCK_KEY})")
            conn.commit()
        return
    database = conn.engine.url.database
    if conn.dialect.name != "sqlite" or database in (None, "", ":memory:"):
        yield
        return
    import fcntl

    with open(f"{database}-migrate.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def schema_lock(url: str) -> Iterator[None]:
    """The migration lock, for another schema in the same database: Optuna's RDB storage creates its
    tables and enum types when first opened, and two tuners opening one new PostgreSQL study together
    would otherwise both run `CREATE TYPE` (the second fails)."""
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn, _migration_lock(conn):
            yield
    finally:
        engine.dispose()


def upgrade(engine: "Engine", revision: str = "head") -> str | None:
    """Upgrade to `revision` (a no-op where it is current already); returns the revision now current."""
    with engine.connect() as conn, _migration_lock(conn):
        return _upgrade(conn, revision)


def _upgrade(conn: "Connection", revision: str) -> str | None:
    """Upgrade on `conn`, which holds the migration lock."""
    from alembic import command

    command.upgrade(alembic_config(conn), revision)
    conn.commit()
    return current_revision(conn)


def downgrade(engine: "Engine", revision: str) -> None:
    from alembic import command

    with engine.connect() as conn:
        command.downgrade(alembic_config(conn), revision)
        conn.commit()


def ensure_schema(engine: "Engine", where: str) -> None:
    """Upgrade a database that has none of our schema; accept one at head; otherwise say what to do."""
    # Read and, on an empty database, create under the migration lock: processes opening one new
    # store together wait on the lock (no timeout), not on SQLite's busy timeout behind the DDL.
    with engine.connect() as conn, _migration_lock(conn):
        current = current_revision(conn)
        if current is None:
            current = _upgrade(conn, "head")
    head = head_revision()
    if current == head:
        return
    from alembic.script import ScriptDirectory

    known = {s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions()}
    if current in known:
        raise StoreError(f"{where} has schema revision {current}, this advisor needs {head}; "
                         f"run `advisor db upgrade --db URL` first")
    raise StoreError(f"{where} has schema revision {current}, unknown to this advisor (written by a newer one?); "
                     f"upgrade advisor or use another --db")

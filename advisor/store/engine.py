"""The store's engine, built in a factory (no import-time globals), and the translation of database
failures into one-line StoreErrors that say which database and what to do."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from advisor.errors import StoreError

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

def resolve_url(url: str | None = None) -> str:
    """`url`, or the settings' database_url; postgresql:// and postgres:// mean psycopg 3."""
    if url is None:
        from advisor.settings import get_settings

        url = get_settings().database_url
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    if not url.startswith(("sqlite", "postgresql+")):
        raise StoreError(f"database URL {url!r} is not supported; give sqlite:///PATH or postgresql://USER@HOST/DB")
    return url


def describe(url: str) -> str:
    """The database for people: a SQLite file's path, or a server URL without its password."""
    from sqlalchemy.engine import make_url

    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        return f"SQLite file {u.database}" if u.database not in (None, "", ":memory:") else "in-memory SQLite"
    return f"database {u.render_as_string(hide_password=True)}"


def make_engine(url: str, *, busy_timeout_s: float | None = None) -> "Engine":
    """An engine for `url` (already resolved). SQLite: WAL, a busy timeout (default: the settings'
    sqlite_busy_timeout_s) and foreign keys on every connection, and the file's directory created."""
    from sqlalchemy import create_engine, event
    from sqlalchemy.engine import make_url

    if busy_timeout_s is None:
        from advisor.settings import get_settings

        busy_timeout_s = get_settings().sqlite_busy_timeout_s

    u = make_url(url)
    if u.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    if u.database and u.database != ":memory:":
        Path(u.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": busy_timeout_s})

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn, _record) -> None:  # noqa: ANN001 (DBAPI objects)
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")  # ms
        _use_wal(cur, busy_timeout_s)  # readers do not block the writer, nor it them
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    return engine


def _use_wal(cur, timeout_s: float) -> None:  # noqa: ANN001 (a DBAPI cursor)
    """Switch the file to WAL (a setting the file keeps). The switch needs the file to itself and
    SQLite answers "database is locked" at once, without its busy handler, while another connection
    holds it (several processes opening a new store together): retry until the busy timeout."""
    import sqlite3
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if str(cur.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
                cur.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _sqlite_message(where: str, text: str) -> str | None:
    if "locked" in text or "busy" in text:
        return (f"{where} is locked by another process (waited past the busy timeout); wait for it to finish, "
                f"stop it, or use another store with --db")
    if "not a database" in text or "malformed" in text or "file is encrypted" in text:
        return (f"{where} is not a readable SQLite database (corrupted?); move it aside to start an empty store, "
                f"or point --db / ADVISOR_DATABASE_URL elsewhere")
    if "unable to open" in text:
        return f"{where} cannot be opened; check that its directory exists and is writable"
    return None


def store_error(url: str, exc: BaseException) -> StoreError:
    """One line for a database failure: which database, what happened, what to do."""
    orig = getattr(exc, "orig", None) or exc
    text = (str(orig).strip().splitlines() or [type(orig).__name__])[0]
    where = describe(url)
    if url.startswith("sqlite"):
        message = _sqlite_message(where, text.lower())
        if message:
            return StoreError(message)
    from sqlalchemy.exc import OperationalError

    if isinstance(exc, OperationalError) and not url.startswith("sqlite"):
        return StoreError(f"{where} failed: {text}; check that the server is running and the URL is right")
    return StoreError(f"{where} failed: {text}")


@contextlib.contextmanager
def guarded(url: str) -> Iterator[None]:
    """Raise database failures (not integrity conflicts, which callers handle) as StoreError."""
    import sqlite3

    from sqlalchemy.exc import IntegrityError, SQLAlchemyError

    try:
        yield
    except IntegrityError:
        raise
    except (SQLAlchemyError, sqlite3.Error) as exc:
        raise store_error(url, exc) from exc

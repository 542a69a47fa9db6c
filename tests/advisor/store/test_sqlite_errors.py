"""A SQLite store that another process holds locked, or that is not a database at all, gives a
StoreError with one line naming the file and what to do, from the API and from the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from store_data import spec

from advisor.errors import StoreError
from advisor.store import open_store

ROOT = Path(__file__).resolve().parents[3]
HOLD_LOCK = """
import sqlite3, sys, time
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
time.sleep(60)
"""


@pytest.fixture
def lock_holder():
    """Starts a process that takes an exclusive lock on a file and keeps it until the test ends."""
    procs = []

    def hold(path: Path) -> None:
        p = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(path)], stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout.readline().strip() == "locked"

    yield hold
    for p in procs:
        p.kill()
        p.wait()


def advisor(*args: str, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "advisor.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_a_write_blocked_past_the_timeout_says_the_file_is_locked(tmp_path, lock_holder):
    db = tmp_path / "advisor.db"
    open_store(f"sqlite:///{db}").close()  # schema in place, WAL mode
    lock_holder(db)
    with open_store(f"sqlite:///{db}", busy_timeout_s=0.3) as store:
        with pytest.raises(StoreError) as info:
            store.create_or_get_study(spec())
    message = str(info.value)
    assert str(db) in message and "locked by another process" in message and "\n" not in message


def test_cli_on_a_locked_file_prints_one_line(tmp_path, lock_holder):
    db = tmp_path / "other-tool.db"
    import sqlite3

    con = sqlite3.connect(db)  # a rollback-journal file: an exclusive lock shuts out readers too
    con.execute("CREATE TABLE t (x)")
    con.commit()
    con.close()
    lock_holder(db)
    line = one_line_error(advisor("results", "list", "--db", f"sqlite:///{db}", ADVISOR_SQLITE_BUSY_TIMEOUT_S="0.3"))
    assert str(db) in line and "locked by another process" in line


def test_garbage_bytes_are_reported_as_not_a_database(tmp_path):
    db = tmp_path / "advisor.db"
    db.write_bytes(os.urandom(4096))
    with pytest.raises(StoreError) as info:
        open_store(f"sqlite:///{db}")
    assert str(db) in str(info.value) and "not a readable SQLite database" in str(info.value)
    for command in (("results", "list"), ("db", "upgrade")):
        line = one_line_error(advisor(*command, "--db", f"sqlite:///{db}"))
        assert str(db) in line and "move it aside" in line

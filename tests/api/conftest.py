"""Fixtures for the service's tests: stores with real measured trials (SQLite, and PostgreSQL where
ADVISOR_TEST_POSTGRES_URL names a server), the app in process, and `advisor serve` as a real
process on a loopback port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from api_common import ROOT, TOKEN, free_port


@pytest.fixture
def seeded(db_url: str) -> tuple[str, dict]:
    """(url, facts) of a store holding one study of real measured tiny-mlp trials on this CPU."""
    from api_seed import seed

    return db_url, seed(db_url)


@pytest.fixture
def make_client() -> Iterator[Callable[..., "object"]]:
    """make_client(url, **settings) -> a TestClient of create_app over that store (lifespan run)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # starlette's note about httpx's successor
        from fastapi.testclient import TestClient

    from advisor.settings import Settings
    from api.app import create_app

    clients = []

    def make(url: str, **settings):  # noqa: ANN202
        client = TestClient(create_app(url, settings=Settings(database_url=url, **settings)),
                            raise_server_exceptions=False)
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.__exit__(None, None, None)


class Server:
    """`advisor serve` in a process of its own (its own session, so a kill reaches only it)."""

    def __init__(self, url: str, data_dir: Path, *args: str, **env: str) -> None:
        self.url, self.data_dir, self.args, self.env = url, data_dir, args, env
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = data_dir / f"serve-{self.port}.log"

    def start(self, timeout: float = 60) -> "Server":
        env = {**os.environ, "ADVISOR_DATA_DIR": str(self.data_dir), "ADVISOR_API_TOKEN": TOKEN,
               "ADVISOR_LOG_LEVEL": "INFO", **self.env}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "advisor.cli", "serve", "--port", str(self.port),
                                          "--db", self.url, *self.args], env=env, cwd=ROOT, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(f"{self.base}/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"advisor serve did not answer in {timeout} s:\n{self.log.read_text()[-3000:]}")

    def client(self, token: str | None = TOKEN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.base, headers=headers, timeout=30)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(60)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def short_data_dir() -> Iterator[Path]:
    """A short data dir for a server and its jobs (Ray's socket paths live under it)."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="advs-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def serve(short_data_dir: Path) -> Iterator[Callable[..., Server]]:
    """serve(url, *serve_args, **env) -> a started Server; every one is stopped afterwards."""
    servers: list[Server] = []

    def start(url: str, *args: str, **env: str) -> Server:
        server = Server(url, short_data_dir, *args, **env).start()
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.stop()


@pytest.fixture
def live_server(sqlite_url: str, serve) -> tuple[str, dict]:  # noqa: ANN001
    """(base URL, facts) of `advisor serve` over a seeded SQLite store, over real HTTP on loopback."""
    from api_seed import seed

    facts = seed(sqlite_url)
    return serve(sqlite_url).base, facts


@pytest.fixture(scope="session")
def artifact_dir() -> Path:
    """Where tests leave files for people (screenshots): ADVISOR_TEST_ARTIFACTS, else .data/test-artifacts."""
    path = Path(os.environ.get("ADVISOR_TEST_ARTIFACTS", ROOT / ".data" / "test-artifacts"))
    path.mkdir(parents=True, exist_ok=True)
    return path


# -- the web page in headless Chromium ---------------------------------------------------------------
TIMEOUT_MS = 30_000  # a page action's default wait
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


def _unavailable(reason: str) -> None:
    if os.environ.get("ADVISOR_TEST_BROWSER") == "required":
        pytest.fail(f"ADVISOR_TEST_BROWSER=required but {reason}")
    pytest.skip(f"{reason} (set ADVISOR_TEST_BROWSER=required to make this a failure)")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium for a test module's page tests (each launch costs seconds). Needs the `playwright`
    package and Chromium at /usr/bin/chromium: where either is missing the tests skip, or fail where
    ADVISOR_TEST_BROWSER=required."""
    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError:
        _unavailable("the Python package playwright is not installed (pip install -e '.[test]')")
    if not CHROMIUM.is_file():
        _unavailable(f"Chromium is not installed at {CHROMIUM}")
    with sync_playwright() as pw:
        try:
            chromium = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        except Error as exc:
            _unavailable(f"Chromium at {CHROMIUM} does not start: {str(exc).splitlines()[0]}")
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh page that records script errors; the test asserts there were none."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    pg.script_errors = []
    pg.on("pageerror", lambda exc: pg.script_errors.append(str(exc)))
    yield pg
    context.close()

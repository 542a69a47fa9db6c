"""`advisor serve` (the HTTP API under uvicorn, with the job worker) and `advisor worker` (the job
worker alone, for a separate process or container). Nothing heavy loads until the command runs."""

from __future__ import annotations

import argparse
import logging

from advisor.errors import SpecError

log = logging.getLogger(__name__)


def add_parsers(sub: argparse._SubParsersAction, positive_int) -> None:  # noqa: ANN001
    serve = sub.add_parser("serve", help="run the HTTP API (and, unless --no-jobs, the tune-job worker)")
    serve.add_argument("--host", default=None, help="address to bind (default ADVISOR_API_HOST, else 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default ADVISOR_API_PORT, else 8000)")
    serve.add_argument("--db", default=None, metavar="URL", help="database URL (default ADVISOR_DATABASE_URL)")
    serve.add_argument("--http-workers", type=positive_int, default=1, metavar="N",
                       help="uvicorn worker processes answering HTTP (the job worker stays one)")
    serve.add_argument("--no-jobs", action="store_true", help="do not run queued tune jobs here (run `advisor worker`)")
    worker = sub.add_parser("worker", help="run queued tune jobs from the database until stopped")
    worker.add_argument("--db", default=None, metavar="URL", help="database URL (default ADVISOR_DATABASE_URL)")


def _url(db: str | None) -> str:
    from advisor.store.engine import resolve_url

    return resolve_url(db)


def cmd_serve(args: argparse.Namespace) -> int:
    import os
    import signal

    import uvicorn

    from advisor.settings import get_settings

    url = _url(args.db)
    os.environ["ADVISOR_DATABASE_URL"] = url  # create_app (here or in uvicorn's workers) reads the environment
    get_settings.cache_clear()
    settings = get_settings()
    host = args.host or settings.api_host
    port = settings.api_port if args.port is None else args.port
    if not 0 < port < 65536:
        raise SpecError(f"--port {port} is not allowed; give 1 to 65535")
    _check_store(url)
    if host not in ("127.0.0.1", "::1", "localhost") and settings.api_token is None:
        log.warning("serving on %s without ADVISOR_API_TOKEN: tune jobs and cancels are refused (403)", host)
    worker = None
    if settings.run_jobs and not args.no_jobs:
        from api.jobs import JobWorker

        worker = JobWorker(url).start()
    from advisor.store.engine import describe

    jobs = (f"tune jobs: {len(worker.slots)} at once ({', '.join(worker.slots)})" if worker
            else "tune jobs: not run here")
    print(f"advisor serve: http://{host}:{port}/ (API under /v1, docs at /docs); store: {describe(url)}; {jobs}",
          flush=True)
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again under the handler it
    # found: make that one a normal exit, so the job worker below stops its jobs and queues them.
    signal.signal(signal.SIGTERM, _exit_zero)
    try:
        uvicorn.run("api.app:create_app", factory=True, host=host, port=port, workers=args.http_workers,
                    log_level=settings.log_level.lower(), access_log=False, proxy_headers=False,
                    server_header=False)
    finally:
        if worker is not None:
            worker.stop()
    return 0


def _exit_zero(signum: int, frame: object) -> None:
    raise SystemExit(0)


def cmd_worker(args: argparse.Namespace) -> int:
    import signal
    import threading

    from api.jobs import JobWorker

    url = _url(args.db)
    _check_store(url)
    worker = JobWorker(url)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    worker.start()
    print(f"advisor worker: {len(worker.slots)} slot(s) ({', '.join(worker.slots)}); waiting for jobs", flush=True)
    done.wait()
    worker.stop()
    return 0


def _check_store(url: str) -> None:
    """Fail at start, in one line, if the store cannot be opened (rather than on the first request)."""
    from advisor.store import open_store

    open_store(url).close()

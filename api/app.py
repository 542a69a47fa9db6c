"""The FastAPI app: `create_app()` builds it; `advisor serve` runs it under uvicorn.

Every route answers JSON; every failure is `{"detail": "..."}` with a 4xx for the caller's mistake
(422 invalid input, or a workload that crashed, hung, outgrew its memory cap or raised in its
isolated worker; 401/403 auth, 404 unknown, 409 conflict, 413 too large) and 503 when the store is
unreachable or every isolated worker is busy and the queue is full (with Retry-After). An
unexpected error is a 500 whose body names a request id, never a trace or a path of this machine;
the log has the rest.
"""

from __future__ import annotations

import logging
import threading
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from advisor.errors import AdvisorError, EstimateError, SpecError, StoreError, TrialError, WorkloadFailed
from advisor.isolation.pool import PoolFull, WorkerPool
from advisor.settings import Settings, get_settings

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
VERSION = "1"


class AppState:
    """What the routes share: settings, the store (opened on first use), caches, metrics, and the pool of
    isolated workers that runs every workload's code (settings.api_workers at once, api_queue waiting)."""

    def __init__(self, settings: Settings, db_url: str | None) -> None:
        from api.cache import RecommendCache
        from api.metrics import Metrics

        self.settings = settings
        self.db_url = db_url or settings.database_url
        self._store = None
        self._lock = threading.Lock()
        self.metrics = Metrics(self.store)
        self.recommend_cache = RecommendCache(settings.recommend_cache_s, lambda: self.store().best_generation())
        self.pool = WorkerPool(settings.api_workers, settings.api_queue)

    def store(self):  # noqa: ANN201 (SqlResultStore; imported lazily)
        if self._store is None:
            with self._lock:
                if self._store is None:
                    from advisor.store import open_store

                    self._store = open_store(self.db_url)
        return self._store

    def close(self) -> None:
        self.pool.close()
        if self._store is not None:
            self._store.close()
            self._store = None


def create_app(db_url: str | None = None, *, settings: Settings | None = None) -> FastAPI:
    """The service over the store at `db_url` (default: settings' database_url)."""
    from api import curve, routes
    from api.fastpath import RecommendFastPath
    from api.metrics import MetricsMiddleware
    from api.security import BodyLimit

    settings = settings or get_settings()
    state = AppState(settings, db_url)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.pool.warm()  # the fork server imports torch in the background; the first estimate need not wait
        yield
        state.close()

    app = FastAPI(title="advisor", version=f"{VERSION}.0",
                  summary="Training-configuration advisor for PyTorch: estimates, recommendations, tune jobs, results.",
                  description=(__doc__ or "").strip(), lifespan=lifespan,
                  docs_url="/docs", redoc_url=None, openapi_url="/openapi.json",
                  telemetry={"tracing": False, "metrics": False, "logs": False})  # /metrics is ours
    app.state.settings = settings
    app.state.advisor = state
    app.include_router(routes.router)
    app.include_router(routes.v1)
    app.include_router(curve.v1)
    _errors(app)
    app.add_middleware(RecommendFastPath, cache=state.recommend_cache)  # innermost of ours: after the limit
    app.add_middleware(BodyLimit, limit=settings.api_max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _detail(errors: list[dict[str, Any]]) -> str:
    """Pydantic's errors as one line: where and what, without echoing the input back."""
    parts = []
    for e in errors[:3]:
        where = ".".join(str(p) for p in e.get("loc", ()) if p not in ("body",)) or "body"
        parts.append(f"{where}: {str(e.get('msg', 'invalid')).removeprefix('Value error, ')}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "; ".join(parts) + more


def _errors(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _detail(list(exc.errors()))}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"detail": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(StoreError)
    async def store_down(request: Request, exc: StoreError) -> JSONResponse:
        log.warning("store error on %s %s: %s", request.method, request.url.path, exc)
        return JSONResponse({"detail": "the result store is unavailable; try again later"}, status_code=503)

    @app.exception_handler(PoolFull)
    async def pool_full(request: Request, exc: PoolFull) -> JSONResponse:
        return JSONResponse({"detail": _one_line(str(exc))}, status_code=503,
                            headers={"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(AdvisorError)
    async def advisor_error(request: Request, exc: AdvisorError) -> JSONResponse:
        if isinstance(exc, WorkloadFailed):
            log.info("%s %s: %s (%s)\n%s", request.method, request.url.path, exc, exc.status, exc.detail)
        code = 422 if isinstance(exc, (SpecError, EstimateError, WorkloadFailed, TrialError)) else 400
        return JSONResponse({"detail": _one_line(str(exc))}, status_code=code)

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        rid = uuid.uuid4().hex[:12]
        log.exception("request %s: %s %s failed", rid, request.method, request.url.path)
        return JSONResponse({"detail": f"internal error (request {rid}); the server's log has the details"},
                            status_code=500)


def _one_line(text: str) -> str:
    """A user-facing message, first line, without this machine's absolute paths."""
    import re

    line = text.strip().splitlines()[0] if text.strip() else "invalid request"
    return re.sub(r"(?<![\w.])/(?:[\w.+-]+/)+([\w.+-]+)", r"\1", line)[:500]


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with our error body in place of its validation-error shape."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, summary=app.summary, description=app.description,
                         routes=app.routes)
    error_ref = {"$ref": "#/components/schemas/ErrorBody"}
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    from api.schemas import ErrorBody

    schemas["ErrorBody"] = jsonable_encoder(ErrorBody.model_json_schema())
    for path in schema.get("paths", {}).values():
        for op in path.values():
            for code, resp in op.get("responses", {}).items():
                if code.startswith(("4", "5")):
                    resp["content"] = {"application/json": {"schema": error_ref}}
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    app.openapi_schema = schema
    return schema

"""Who may do what over HTTP: the bearer token for changes, the workload allowlist, body size.

- `POST /v1/tune` and `DELETE /v1/jobs/{id}` need `Authorization: Bearer $ADVISOR_API_TOKEN`;
  with no token configured they are refused (403): a service nobody secured runs nobody's code.
- A workload named over the API is a built-in preset, or `pkg.module:build` whose module is one
  of ADVISOR_WORKLOAD_MODULES or under one; file paths are never imported on a request's say-so.
  `hf:PATH` is read as data (a config.json, built by transformers' own classes, never remote code), and only
  at or under a folder of ADVISOR_HF_CONFIG_DIRS: a request cannot make the server read, or say whether there
  is, a file anywhere else.
- Bodies larger than ADVISOR_API_MAX_BODY_BYTES are refused (413) before they are read whole.
"""

from __future__ import annotations

import re
import secrets

from fastapi import HTTPException, Request, status
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from advisor.settings import Settings

_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def require_token(request: Request) -> None:
    """FastAPI dependency: the request carries the configured bearer token."""
    settings: Settings = request.app.state.settings
    if settings.api_token is None or not settings.api_token.get_secret_value():
        raise HTTPException(status.HTTP_403_FORBIDDEN,
                            "this server accepts no changes: it has no ADVISOR_API_TOKEN set")
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "send Authorization: Bearer <token> (the server's "
                            "ADVISOR_API_TOKEN)", headers={"WWW-Authenticate": "Bearer"})
    if not secrets.compare_digest(given.encode(), settings.api_token.get_secret_value().encode()):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "the bearer token is not this server's",
                            headers={"WWW-Authenticate": "Bearer"})


def check_workload(spec: str, settings: Settings) -> None:
    """403 unless `spec` is a preset or an allowed `pkg.module:function`; 422 if it is neither form."""
    from advisor.presets import PRESETS

    if spec in PRESETS:
        return
    if spec.startswith("hf:"):
        _check_hf_path(spec.removeprefix("hf:"), settings)
        return
    module, sep, function = spec.partition(":")
    allowed = settings.workload_module_prefixes()
    if not sep:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"unknown preset {spec[:80]!r}; GET /v1/workloads "
                            "lists the presets")
    if not _MODULE.match(module) or not function.isidentifier():
        raise HTTPException(status.HTTP_403_FORBIDDEN, "over the API a workload is a preset or pkg.module:build "
                            "inside ADVISOR_WORKLOAD_MODULES; file paths are not accepted")
    if not any(module == p or module.startswith(p + ".") for p in allowed):
        where = ", ".join(allowed) if allowed else "none are allowed on this server"
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"module {module!r} is not in ADVISOR_WORKLOAD_MODULES "
                            f"({where})")


def _check_hf_path(path: str, settings: Settings) -> None:
    """403 unless `path` is absolute and, symbolic links followed, at or under a folder of ADVISOR_HF_CONFIG_DIRS;
    decided on the path alone, before anything is read."""
    from pathlib import Path

    folders = settings.hf_config_folders()
    if not folders:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "this server reads no Hugging Face configs: it has no "
                            "ADVISOR_HF_CONFIG_DIRS set (the hub is not reached)")
    where = ", ".join(str(f) for f in folders)
    if not Path(path).is_absolute():
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"over the API, hf: takes an absolute path under "
                            f"ADVISOR_HF_CONFIG_DIRS ({where}); the hub is not reached")
    resolved = Path(path).resolve()
    if not any(resolved == f or f in resolved.parents for f in folders):
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"hf: path {path[:120]!r} is outside ADVISOR_HF_CONFIG_DIRS "
                            f"({where})")


class BodyLimit:
    """ASGI middleware: 413 for a body over `limit` bytes, by Content-Length or as it streams in."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await _too_large(send, self.limit)
            return
        seen = 0
        started = False

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited, tracking_send)
        except _TooLarge:
            if not started:
                await _too_large(send, self.limit)


class _TooLarge(BaseException):  # not Exception: FastAPI turns those raised while reading a body into 400s
    pass


async def _too_large(send: Send, limit: int) -> None:
    import json

    body = json.dumps({"detail": f"request body over {limit} bytes (ADVISOR_API_MAX_BODY_BYTES)"}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})

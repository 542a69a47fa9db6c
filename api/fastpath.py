"""A response cache in front of the app for POST /v1/recommend, keyed by the request's exact bytes.

The route itself answers from memory (api/cache.py), but under load most of a request's cost is
the framework around it: routing, body validation, dependency solving, serialization. This ASGI
layer answers a body it has seen, byte for byte, with the bytes the route answered then, as long
as the store's best-generation it was computed under is still current (re-read once every
ADVISOR_RECOMMEND_CACHE_S, by one request at a time). Anything else — a new body, an error, a stale
generation — goes to the app unchanged, with the body replayed.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from api.cache import RecommendCache

PATH = "/v1/recommend"
MAX_ENTRIES = 4096
MAX_KEY_BYTES = 8192  # larger bodies are not remembered (they still get the route's cache)


class RecommendFastPath:
    def __init__(self, app: ASGIApp, cache: "RecommendCache") -> None:
        self.app, self.cache = app, cache
        self.entries: OrderedDict[bytes, tuple[object, bytes]] = OrderedDict()
        self.route = None  # the route's object, for the metrics' label on a hit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != PATH or not self.cache.enabled:
            await self.app(scope, receive, send)
            return
        body, more, messages = b"", True, []
        while more:  # the body (the size limit in front of this layer bounds it)
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            more = message.get("more_body", False)
        generation = await self.cache.generation()
        hit = self.entries.get(body) if not more else None
        if hit is not None and hit[0] == generation:
            self.entries.move_to_end(body)
            scope["route"] = self.route
            await _send_json(send, hit[1])
            return
        replay = iter(messages)

        async def replayed() -> Message:
            return next(replay, None) or await receive()

        status, chunks = 0, []

        async def capture(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
            await send(message)

        await self.app(scope, replayed, capture)
        self.route = scope.get("route", self.route)
        if status == 200 and len(body) <= MAX_KEY_BYTES and self.cache.current() == generation:
            self.entries[body] = (generation, b"".join(chunks))
            while len(self.entries) > MAX_ENTRIES:
                self.entries.popitem(last=False)


async def _send_json(send: Send, payload: bytes) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})

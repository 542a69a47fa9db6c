"""Recommendations served from memory until the store's best configurations change.

A recommendation is computed from the store's best configurations (measured or transferred) and
the estimator; computing one builds the workload's model. The cache keys on the request's
canonical JSON and remembers the store's best-generation it was computed under. The generation is
read again once `ttl_s` has passed, by one request at a time in a worker thread (the others keep
answering from what is cached meanwhile), so a newly stored best shows within about `ttl_s`.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

from fastapi.concurrency import run_in_threadpool

MAX_ENTRIES = 1024


def cache_key(body: dict[str, Any]) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)


class RecommendCache:
    def __init__(self, ttl_s: float, read_generation: Callable[[], Any]) -> None:
        self.ttl_s = ttl_s
        self.read_generation = read_generation
        self._entries: OrderedDict[str, tuple[Any, bytes]] = OrderedDict()
        self._generation: Any = None
        self._checked = float("-inf")
        self._refreshing = False
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def current(self) -> Any:
        """The store's best-generation as last read."""
        return self._generation

    async def generation(self) -> Any:
        """The generation, re-read first if `ttl_s` has passed and no other request is re-reading it."""
        if not self._claim_refresh():
            return self._generation
        try:
            generation = await run_in_threadpool(self.read_generation)
            with self._lock:
                if generation != self._generation:
                    self._entries.clear()
                self._generation = generation
                self._checked = time.monotonic()
        finally:
            self._refreshing = False
        return self._generation

    def _claim_refresh(self) -> bool:
        with self._lock:
            if self._refreshing or time.monotonic() - self._checked < self.ttl_s:
                return False
            self._refreshing = True
            return True

    def get(self, key: str, generation: Any) -> bytes | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None or found[0] != generation:
                return None
            self._entries.move_to_end(key)
            return found[1]

    def put(self, key: str, generation: Any, body: bytes) -> None:
        with self._lock:
            if generation != self._generation:
                return  # computed under an older store state
            self._entries[key] = (generation, body)
            self._entries.move_to_end(key)
            while len(self._entries) > MAX_ENTRIES:
                self._entries.popitem(last=False)

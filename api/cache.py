"""Recommendations served from memory until the store's best configurations change.

A recommendation is computed from the store's best configurations (measured or transferred) and
the estimator; computing one builds the workload's model. The cache keys on the request's
canonical JSON and remembers the store's best-generation it was computed under; the generation
is read again at most every `ttl_s` seconds, so a newly stored best shows within that time.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

MAX_ENTRIES = 1024


def cache_key(body: dict[str, Any]) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)


class RecommendCache:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, tuple[Any, bytes]] = OrderedDict()
        self._generation: Any = None
        self._checked = float("-inf")
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def generation_due(self) -> bool:
        return time.monotonic() - self._checked >= self.ttl_s

    def set_generation(self, generation: Any) -> None:
        with self._lock:
            if generation != self._generation:
                self._entries.clear()
            self._generation = generation
            self._checked = time.monotonic()

    def get(self, key: str) -> bytes | None:
        if self.ttl_s <= 0:
            return None
        with self._lock:
            found = self._entries.get(key)
            if found is None or found[0] != self._generation:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return found[1]

    def put(self, key: str, generation: Any, body: bytes) -> None:
        with self._lock:
            if generation != self._generation:
                return  # computed under an older store state
            self._entries[key] = (generation, body)
            self._entries.move_to_end(key)
            while len(self._entries) > MAX_ENTRIES:
                self._entries.popitem(last=False)

    def refresh(self, read_generation: Callable[[], Any]) -> Any:
        """The current generation, read from the store if the last read is older than ttl_s."""
        if self.generation_due():
            self.set_generation(read_generation())
        return self._generation

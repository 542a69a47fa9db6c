"""The tuner's Ray Tune searcher: the queued configurations (baseline, retries) first, then Optuna's, in one
experiment, so one Ray actor (reused trial after trial) keeps one fork server and one isolation worker.

The Optuna side is built only once the queued trials have finished: the baseline must enter Optuna's study
as the screen's reference (driver._seed_reference) before the sampler is first asked. Ray pickles searchers
with its experiment state, so what cannot be pickled (the factory, the hook) lives in `_FACTORIES`.
"""

from __future__ import annotations

import itertools
import os
import pickle
from typing import Any, Callable

from ray.tune.search import Searcher

_FACTORIES: dict[int, Callable[[], Searcher]] = {}
_KEYS = itertools.count()


class QueueThenSearch(Searcher):
    """Suggests each queued `training_config` (JSON) once, waits for them to finish, then builds the inner
    searcher with `factory()` (which may first seed Optuna's study from their results) and delegates to it."""

    def __init__(self, queued: list[str], factory: Callable[[], Searcher], metric: Any, mode: Any) -> None:
        super().__init__(metric=metric, mode=mode)
        self._queued = list(queued)
        self._pending: set[str] = set()  # Ray trial ids of queued configurations still running
        self._inner: Searcher | None = None
        self._key = next(_KEYS)
        _FACTORIES[self._key] = factory

    def set_search_properties(self, metric, mode, config, **spec) -> bool:  # noqa: ANN001 - Ray's signature
        return True  # metric and mode are ours; the space is the inner searcher's

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        if self._queued:
            self._pending.add(trial_id)
            return {"training_config": self._queued.pop(0)}
        if self._pending:
            return None  # Ray asks again once a queued trial has finished
        if self._inner is None:
            self._inner = _FACTORIES[self._key]()
        return self._inner.suggest(trial_id)

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
        if trial_id not in self._pending and self._inner is not None:
            self._inner.on_trial_result(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False) -> None:
        if trial_id in self._pending:
            self._pending.discard(trial_id)
        elif self._inner is not None:
            self._inner.on_trial_complete(trial_id, result=result, error=error)

    def close(self) -> None:
        """Forget the factory (call once the experiment is over)."""
        _FACTORIES.pop(self._key, None)

    # Ray checkpoints the searcher; a rerun resumes from our store and Optuna's, not from these files.
    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump({"queued": self._queued, "pending": self._pending}, f)
        if self._inner is not None:
            self._inner.save(checkpoint_path + ".inner")

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            state = pickle.load(f)
        self._queued, self._pending = state["queued"], state["pending"]
        if os.path.exists(checkpoint_path + ".inner"):
            self._inner = _FACTORIES[self._key]()
            self._inner.restore(checkpoint_path + ".inner")

"""The tuner's Ray Tune searcher: the queued configurations (baseline, retries) first, then Optuna's, then the
leaders measured again (advisor/tune/confirm.py), in one experiment, so one Ray actor (reused trial after trial)
keeps one fork server and one isolation worker.

The Optuna side is built only once the queued trials have finished: the baseline must enter Optuna's study
as the screen's reference (driver._seed_reference) before the sampler is first asked. Ray pickles searchers
with its experiment state, so what cannot be pickled (the factory, the confirmer and its store) lives in
`_FACTORIES` and `_CONFIRMS`.
"""

from __future__ import annotations

import itertools
import os
import pickle
from typing import Any, Callable

from ray.tune.search import Searcher

_FACTORIES: dict[int, Callable[[], Searcher]] = {}
_CONFIRMS: dict[int, Any] = {}
_KEYS = itertools.count()
# Draws of the inner searcher per suggestion that may repeat a configuration whose result is known, each answered
# at once; a sampler that repeats itself this many times in a row has a spent space (a grid measured whole, or what
# TPE's model leaves of it): the experiment measures the leaders again while --confirm keeps trials for that,
# then ends
MAX_REDRAWS = 64


class QueueThenSearch(Searcher):
    """Suggests each queued `training_config` (JSON) once, waits for them to finish, then builds the inner
    searcher with `factory()` (which may first seed Optuna's study from their results) and delegates to it.
    With `confirm` (an object with `due()` and `pick()`), once `due()` holds and the inner searcher's trials in
    flight are in, each suggestion is `pick()`'s configuration to measure again (marked `repeat`) while it
    gives one; those never reach the inner searcher. Each trial reports once, so the inner searcher is told a
    trial's result as it arrives: a budget that ends the experiment on that result loses none of it.

    A draw of a configuration whose result the experiment already has is told that result at once and the
    inner searcher asked again (up to MAX_REDRAWS times a suggestion), so a sampler that repeats itself (TPE
    on a small grid) spends no trial of the experiment on a repeat. Where all those draws repeat (`spent`), the
    suggestion is `confirm`'s next leader to measure again, due or not (where it keeps any trials for that), and
    the search is FINISHED once there is none."""

    def __init__(self, queued: list[str], factory: Callable[[], Searcher], metric: Any, mode: Any,
                 confirm: Any = None) -> None:
        super().__init__(metric=metric, mode=mode)
        self._queued = list(queued)
        self._pending: set[str] = set()  # Ray trial ids of queued configurations still running
        self._repeats: set[str] = set()  # Ray trial ids measuring a configuration again
        self._live: dict[str, str] = {}  # Ray trial id -> the inner searcher's id, of those whose result is not in
        self._inner: Searcher | None = None
        self._configs: dict[str, str] = {}  # Ray trial id -> its training_config (JSON)
        self._known: dict[str, dict[str, Any]] = {}  # training_config (JSON) -> its reported result
        self.redrawn = 0  # draws answered with a known result
        self.spent = False  # a suggestion's MAX_REDRAWS draws all had a known result: the space looks spent
        self._key = next(_KEYS)
        _FACTORIES[self._key] = factory
        if confirm is not None:
            _CONFIRMS[self._key] = confirm

    def set_search_properties(self, metric, mode, config, **spec) -> bool:  # noqa: ANN001 - Ray's signature
        return True  # metric and mode are ours; the space is the inner searcher's

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        if self._queued:
            self._pending.add(trial_id)
            self._configs[trial_id] = self._queued[0]
            return {"training_config": self._queued.pop(0)}
        if self._pending:
            return None  # Ray asks again once a queued trial has finished
        confirm = _CONFIRMS.get(self._key)
        if confirm is not None and confirm.due():
            if self._live:
                return None  # the leaders are known once the trials in flight are in
            again = confirm.pick()
            if again is not None:
                self._repeats.add(trial_id)
                return {"training_config": again, "repeat": True}
        if self._inner is None:
            self._inner = _FACTORIES[self._key]()
        if not self.spent:
            inner_id, suggested = self._draw(trial_id)
        if self.spent:  # nothing new to draw: the leaders measured again while any is due, then the end
            again = confirm.pick() if confirm is not None and confirm.reserve > 0 else None
            if again is None:
                return Searcher.FINISHED
            self._repeats.add(trial_id)
            return {"training_config": again, "repeat": True}
        if isinstance(suggested, dict):
            self._live[trial_id] = inner_id
            self._configs[trial_id] = suggested.get("training_config")
        return suggested

    def _draw(self, trial_id: str) -> tuple[str, dict[str, Any] | None]:
        """(the inner searcher's id for it, its suggestion) for Ray's `trial_id`, past the draws whose result is
        known (class docstring); (its id, None) with `spent` set where all MAX_REDRAWS draws were."""
        inner_id, n = trial_id, 0
        suggested = self._inner.suggest(inner_id)
        while isinstance(suggested, dict) and (known := self._known.get(suggested.get("training_config"))) is not None:
            self._inner.on_trial_complete(inner_id, result=known)
            self.redrawn, n = self.redrawn + 1, n + 1
            if n == MAX_REDRAWS:
                self.spent = True
                return inner_id, None
            inner_id = f"{trial_id}-redraw{n}"
            suggested = self._inner.suggest(inner_id)
        return inner_id, suggested

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
        config = self._configs.get(trial_id)
        if config is not None and not result.get("repeat"):
            self._known.setdefault(config, result)
        if trial_id in self._live and self._inner is not None:
            self._inner.on_trial_complete(self._live.pop(trial_id), result=result)

    def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False) -> None:
        if trial_id in self._pending:
            self._pending.discard(trial_id)
        elif trial_id in self._repeats:
            self._repeats.discard(trial_id)
        elif trial_id in self._live and self._inner is not None:  # ended without reporting (its actor died)
            self._inner.on_trial_complete(self._live.pop(trial_id), result=result, error=error)

    def close(self) -> None:
        """Forget the factory and the confirmer (call once the experiment is over)."""
        _FACTORIES.pop(self._key, None)
        _CONFIRMS.pop(self._key, None)

    # Ray checkpoints the searcher; a rerun resumes from our store and Optuna's, not from these files.
    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump({"queued": self._queued, "pending": self._pending, "repeats": self._repeats,
                         "live": self._live, "configs": self._configs, "known": self._known, "spent": self.spent}, f)
        if self._inner is not None:
            self._inner.save(checkpoint_path + ".inner")

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            state = pickle.load(f)
        self._queued, self._pending = state["queued"], state["pending"]
        self._repeats, self._live = state.get("repeats", set()), state.get("live", {})
        self._configs, self._known = state.get("configs", {}), state.get("known", {})
        self.spent = state.get("spent", False)
        if os.path.exists(checkpoint_path + ".inner"):
            self._inner = _FACTORIES[self._key]()
            self._inner.restore(checkpoint_path + ".inner")

"""Ray Tune hooks of the tuner: the budget stopper and the progress callback (imports Ray).

Ray pickles its callbacks and stoppers with the experiment's state, so they are module-level
classes (pickled by reference) and the progress display, which does not pickle (locks, a
terminal), is kept in `_LISTENERS` under a key rather than on the callback.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

from ray.tune import Callback, Stopper

_LISTENERS: dict[int, Callable[[dict[str, Any], int, int], None]] = {}
_KEYS = itertools.count()


class BudgetStopper(Stopper):
    """Ends the experiment when the budget says so (distinct configurations, patience)."""

    def __init__(self, budget: Any) -> None:
        self.budget = budget

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        return False  # each trial reports once and ends by itself

    def stop_all(self) -> bool:
        return self.budget.done()


class ProgressCallback(Callback):
    """Feeds each trial's result to the budget and to the caller's progress display."""

    def __init__(self, budget: Any, total: int, on_result: Callable[[dict[str, Any], int, int], None] | None) -> None:
        self.budget, self.total, self.count = budget, total, 0
        self.key = next(_KEYS)
        if on_result is not None:
            _LISTENERS[self.key] = on_result

    def on_trial_result(self, iteration, trials, trial, result, **info):  # noqa: D102 - Ray's hook
        self.deliver(result, trial.config.get("training_config"))

    def deliver(self, result: dict[str, Any], config: str | None) -> None:
        """One trial's result (its `training_config` JSON beside it) to the budget and the listener."""
        self.count += 1
        self.budget.observe(result)
        listener = _LISTENERS.get(self.key)
        if listener is not None:
            listener({**result, "config": config}, len(self.budget.seen), self.total)

    def close(self) -> None:
        _LISTENERS.pop(self.key, None)

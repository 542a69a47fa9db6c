"""The tuner: search spaces sampled by Optuna through Ray Tune, trials measured for real, every
outcome stored; a rerun continues its study. `run_tune(TuneRequest(...))`."""

from __future__ import annotations

from typing import Any

__all__ = ["TuneRequest", "run_tune"]


def __getattr__(name: str) -> Any:  # ray and optuna load only when a tune runs
    if name == "TuneRequest":
        from advisor.tune.request import TuneRequest

        return TuneRequest
    if name == "run_tune":
        from advisor.tune.driver import run_tune

        return run_tune
    raise AttributeError(name)

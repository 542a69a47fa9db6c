"""Where a long estimate is, for whoever shows progress (the CLI's spinner). The estimator reports
its stages (tracing, calibration runs in fresh processes, runs near the largest batch) with
`report`; a caller that wants them wraps the estimate in `listening(callback)`. Nothing is reported
where no one listens. A context variable, so concurrent estimates (the API's threads) keep theirs apart."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator

_listener: ContextVar[Callable[[str], None] | None] = ContextVar("advisor_estimate_stage", default=None)


def report(stage: str) -> None:
    """Tell the listener, if any, what the estimate does now (one short line)."""
    listener = _listener.get()
    if listener is not None:
        listener(stage)


@contextmanager
def listening(callback: Callable[[str], None]) -> Iterator[None]:
    """Send the stages of estimates made inside the block to `callback`."""
    token = _listener.set(callback)
    try:
        yield
    finally:
        _listener.reset(token)

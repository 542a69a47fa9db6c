"""An isolated worker: a fork of the isolation fork server that runs calls for its parent, one at a time.

It leads its own session and process group (the parent kills it and whatever it started together),
writes its output to a log, and talks to the parent over a Unix socket with pickled tuples:
from the parent `(function, args, kwargs)`; to it `("stage", text)` and `("part", name)` while the
call runs, then exactly one of `("ok", value)`, `("raised", error_or_None, type, message, tail)` or
`("exited", part, code, tail)` (the call raised SystemExit: the worker exits after saying so), where
`part` is the workload's part the exception left (None: none).
"""

from __future__ import annotations

import os
import socket
import traceback
from multiprocessing.connection import Connection
from typing import Any

from advisor.errors import AdvisorError

TRACEBACK_LINES = 12  # lines of a traceback sent with a failure


def _tail(exc: BaseException) -> str:
    lines = "".join(traceback.format_exception(exc)).rstrip().splitlines()
    return "\n".join(lines[-TRACEBACK_LINES:])


def _picklable(exc: BaseException) -> BaseException | None:
    """`exc` where the parent can raise it as is (the advisor's own errors), else None."""
    import pickle

    if not isinstance(exc, AdvisorError):
        return None
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - an error whose arguments do not pickle is sent as text
        return None


def _failed_in(exc: BaseException) -> str | None:
    """The workload's part (advisor.workload.PARTS) the exception, or one it was raised from, left first."""
    from advisor.workload import FAILED_IN

    while exc is not None:
        if hasattr(exc, FAILED_IN):
            return getattr(exc, FAILED_IN)
        exc = exc.__cause__ or exc.__context__
    return None


def _serve(conn: Connection, fn: Any, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Run one call and answer it; False when the worker must exit (the call raised SystemExit)."""
    from advisor.estimate.stages import listening
    from advisor.workload import watching_parts

    with listening(lambda text: conn.send(("stage", text))), watching_parts(lambda part: conn.send(("part", part))):
        try:
            value = fn(*args, **kwargs)
        except SystemExit as exc:
            conn.send(("exited", _failed_in(exc), exc.code, _tail(exc)))
            return False
        except BaseException as exc:  # noqa: BLE001 - every failure of the call is the parent's to report
            conn.send(("raised", _failed_in(exc), _picklable(exc), type(exc).__name__, str(exc), _tail(exc)))
            return True
    try:
        conn.send(("ok", value))
    except Exception as exc:  # noqa: BLE001 - a value that does not pickle is a bug of the caller's function
        conn.send(("raised", None, None, type(exc).__name__, f"its result could not be sent: {exc}", _tail(exc)))
    return True


def main(sock_path: str, log_path: str) -> None:
    """Entry from the fork server: connect to the parent at `sock_path`, then serve calls until it hangs up."""
    from advisor.isolation.forkserver import own_group

    own_group(log_path, os.O_APPEND)  # a log per worker, its calls one after another
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(sock_path)
    conn = Connection(sock.detach())
    while True:
        try:
            fn, args, kwargs = conn.recv()
        except (EOFError, OSError):  # the parent is gone, or retired this worker
            os._exit(0)
        except Exception as exc:  # noqa: BLE001 - a call that does not unpickle here (a function of __main__)
            conn.send(("raised", None, None, type(exc).__name__, f"the call could not be received: {exc}", _tail(exc)))
            continue
        if not _serve(conn, fn, args, kwargs):
            os._exit(0)

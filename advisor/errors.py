"""One exception tree for the advisor: every user-facing failure is an AdvisorError."""

from __future__ import annotations


class AdvisorError(Exception):
    """Base of every error the advisor raises on purpose; its message is one line for the user."""


class SpecError(AdvisorError):
    """A user's input (preset, hardware, workload file, knob value) is not valid."""


class WorkloadError(SpecError):
    """A workload file or module could not be imported, or its build() raised."""


class WorkloadFailed(AdvisorError):
    """User code run in an isolated process (advisor/isolation) failed there: it crashed on a signal, ran past
    its time limit or memory cap, exited, or raised. `status` is the trial status it is recorded as
    ('crashed', 'timeout', 'oom' or 'error'); `detail` the traceback's or the process log's tail."""

    def __init__(self, message: str, *, status: str, detail: str = "") -> None:
        super().__init__(message)
        self.status, self.detail = status, detail

    def __reduce__(self):  # noqa: ANN204 - keyword-only fields survive pickling across processes
        return (_workload_failed, (str(self), self.status, self.detail))


def _workload_failed(message: str, status: str, detail: str) -> WorkloadFailed:
    return WorkloadFailed(message, status=status, detail=detail)


class EstimateError(AdvisorError):
    """The estimator cannot estimate this case; the message says exactly why."""


class ProbeError(AdvisorError):
    """Probing the local hardware failed."""


class TrialError(AdvisorError):
    """A measured trial could not be launched or its result could not be read."""


class StoreError(AdvisorError):
    """The result store is unreachable, locked or corrupted."""


def invalid_input(exc: Exception, flags: dict[str, str] | None = None) -> SpecError:
    """One line from pydantic's ValidationError `exc`: its first error's field, named by the CLI flag
    `flags` maps it to where there is one, and what is allowed (pydantic's message)."""
    err = exc.errors()[0]  # type: ignore[attr-defined] - a pydantic ValidationError
    field = ".".join(map(str, err["loc"]))
    where = (flags or {}).get(field, field)
    msg = err["msg"].removeprefix("Value error, ")
    return SpecError(f"{where}: {msg}" if where else msg)

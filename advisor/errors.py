"""One exception tree for the advisor: every user-facing failure is an AdvisorError."""

from __future__ import annotations


class AdvisorError(Exception):
    """Base of every error the advisor raises on purpose; its message is one line for the user."""


class SpecError(AdvisorError):
    """A user's input (preset, hardware, workload file, knob value) is not valid."""


class WorkloadError(SpecError):
    """A workload file or module could not be imported, or its build() raised."""


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

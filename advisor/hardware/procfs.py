"""Reading procfs/sysfs text: the two roots, file readers that raise ProbeError, and the cpulist format."""

from __future__ import annotations

from pathlib import Path

from advisor.errors import ProbeError

PROC = Path("/proc")
SYS = Path("/sys")


def read_text(path: Path) -> str:
    """A file that must be there; ProbeError naming it when it cannot be read."""
    try:
        return path.read_text()
    except OSError as err:
        raise ProbeError(f"cannot read {path}: {err.strerror or err}") from err


def read_optional(path: Path) -> str | None:
    """A file that legitimately may be absent (None then); ProbeError for any other failure."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise ProbeError(f"cannot read {path}: {err.strerror or err}") from err


def parse_cpulist(text: str) -> list[int]:
    """Parse the kernel's cpulist format ('0-3,8-11', '5', '') into sorted CPU ids."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        try:
            lo, hi = int(first), int(last or first)
        except ValueError as err:
            raise ProbeError(f"malformed cpulist {text.strip()!r}: expected e.g. '0-3,8-11'") from err
        if hi < lo:
            raise ProbeError(f"malformed cpulist {text.strip()!r}: range {part!r} runs backwards")
        cpus.update(range(lo, hi + 1))
    return sorted(cpus)

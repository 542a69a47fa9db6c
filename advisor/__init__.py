"""advisor: estimate, measure and tune PyTorch training configurations.

Heavy modules (torch) load lazily, so `advisor --help` stays fast.
"""

from __future__ import annotations

from typing import Any

from advisor.errors import AdvisorError
from advisor.workload import DecoderArch, Workload

__all__ = ["AdvisorError", "DecoderArch", "Workload", "estimate_memory", "get_hardware", "load_workload"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "estimate_memory":
        from advisor.estimate import estimate_memory

        return estimate_memory
    if name == "get_hardware":
        from advisor.hardware import get_hardware

        return get_hardware
    if name == "load_workload":
        from advisor.workload import load_workload

        return load_workload
    raise AttributeError(name)

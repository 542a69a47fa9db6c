"""advisor: estimate, measure and tune PyTorch training configurations.

Heavy modules (torch) load lazily, so `advisor --help` stays fast.
"""

from __future__ import annotations

from typing import Any

from advisor.errors import AdvisorError
from advisor.workload import DecoderArch, Workload

__all__ = ["AdvisorError", "DecoderArch", "EstimateOptions", "EstimateRequest", "Workload", "estimate_memory",
           "get_hardware", "load_workload"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("estimate_memory", "EstimateRequest", "EstimateOptions"):
        import advisor.estimate

        return getattr(advisor.estimate, name)
    if name == "get_hardware":
        from advisor.hardware import get_hardware

        return get_hardware
    if name == "load_workload":
        from advisor.workload import load_workload

        return load_workload
    raise AttributeError(name)

"""Measured trials and hardware benchmarks: `run_trial` measures one TrainingConfig (advisor.trial) for real.

The local hardware probe (NVML, sysfs) lives in advisor.hardware.probe.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_trial"]


def __getattr__(name: str) -> Any:  # lazy: `import probes` must not import torch
    if name == "run_trial":
        from probes.runner import run_trial

        return run_trial
    raise AttributeError(name)

"""Measured trials and hardware benchmarks: `run_trial` measures one TrainingConfig for real.

The local hardware probe (NVML, sysfs) lives in advisor.hardware.probe.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TrainingConfig", "TrialBudget", "TrialResult", "TrialStatus", "run_trial"]


def __getattr__(name: str) -> Any:  # lazy: `import probes` must not import torch
    if name == "run_trial":
        from probes.runner import run_trial

        return run_trial
    if name in ("TrainingConfig", "TrialBudget"):
        import probes.config as config

        return getattr(config, name)
    if name in ("TrialResult", "TrialStatus"):
        import probes.result as result

        return getattr(result, name)
    raise AttributeError(name)

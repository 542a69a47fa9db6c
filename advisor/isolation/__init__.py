"""A workload's code runs in isolated workers (pool.py), with a time limit and a memory cap from the settings;
these are the calls the CLI, the trial runner, the tuner and the API make through them.

A workload given as an object (the Python API's `estimate_memory(Workload(...), ...)`) is the caller's own
code in the caller's own process, and is estimated there.
"""

from __future__ import annotations

import collections
import json
import os
import threading
from typing import TYPE_CHECKING, Any, Callable, TypeVar

if TYPE_CHECKING:
    from advisor.estimate.model import EstimateOptions, EstimateRequest, MemoryEstimate
    from advisor.hardware.spec import HardwareSpec
    from advisor.isolation.pool import WorkerPool
    from advisor.workload import Workload, WorkloadInfo

T = TypeVar("T")
__all__ = ["describe", "estimate", "estimate_layout", "run_isolated"]


def run_isolated(fn: Callable[..., T], *args: Any, spec: str, what: str, stage: str, timeout_s: float | None = None,
                 memory_cap_bytes: int | None = None, pool: WorkerPool | None = None, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` in a worker of `pool` (default: this process's), for workload `spec`; the worker
    is retired after it where `spec` names code from outside the advisor (file.py:build, pkg.module:build).
    Time limit `timeout_s` (default settings.estimate_timeout_s); memory cap settings.memory_cap_bytes(), or
    `memory_cap_bytes` where that is lower (a trial's own cap)."""
    from advisor.isolation.pool import default_pool
    from advisor.settings import get_settings

    settings = get_settings()
    cap = settings.memory_cap_bytes()
    cap = min(cap, memory_cap_bytes) if memory_cap_bytes else cap
    return (pool or default_pool()).call(fn, *args, what=what, stage=stage, retire=":" in spec,
                                         timeout_s=timeout_s or settings.estimate_timeout_s,
                                         memory_cap_bytes=cap, **kwargs)


# A preset's estimates without calibration runs, by their inputs, for callers that reuse them: a trial's runner
# asks again for the estimate the tuner's feasibility check just made (half a second a trace); least recently used
# dropped
_ESTIMATES: collections.OrderedDict[tuple, "MemoryEstimate"] = collections.OrderedDict()
_ESTIMATES_LOCK = threading.Lock()
ESTIMATES_KEPT = 256


def estimate(workload: "str | Workload", hardware: "HardwareSpec | str", request: "EstimateRequest | None" = None,
             options: "EstimateOptions | None" = None, *, workload_args: dict[str, Any] | None = None,
             timeout_s: float | None = None, memory_cap_bytes: int | None = None,
             pool: WorkerPool | None = None, reuse: bool = False) -> "MemoryEstimate":
    """advisor.estimate.estimate_memory, isolated where `workload` is a name (see the module docstring). `reuse`:
    a preset estimated without calibration (options.calibrate False) with the same inputs, settings, environment
    and measured peaks as an earlier reusing call of this process gets that call's answer (a copy) untraced."""
    from advisor.estimate import estimate_memory

    if not isinstance(workload, str):
        return estimate_memory(workload, hardware, request, options, workload_args=workload_args)
    key = _estimate_key(workload, hardware, request, options, workload_args) if reuse else None
    with _ESTIMATES_LOCK:
        if key is not None and key in _ESTIMATES:
            _ESTIMATES.move_to_end(key)
            return _ESTIMATES[key].model_copy(deep=True)
    answer = run_isolated(estimate_memory, workload, hardware, request, options, workload_args=workload_args,
                          spec=workload, what="the estimate", stage=f"loading {workload}", timeout_s=timeout_s,
                          memory_cap_bytes=memory_cap_bytes, pool=pool)
    if key is not None:
        with _ESTIMATES_LOCK:
            _ESTIMATES[key] = answer.model_copy(deep=True)
            while len(_ESTIMATES) > ESTIMATES_KEPT:
                _ESTIMATES.popitem(last=False)
    return answer


def _estimate_key(workload: str, hardware: "HardwareSpec | str", request: "EstimateRequest | None",
                  options: "EstimateOptions | None", workload_args: dict[str, Any] | None) -> tuple | None:
    """What an uncalibrated estimate of a preset depends on, or None where it may change between calls: code from
    outside the advisor (a file or module, which may be edited), calibration runs (whose cache grows)."""
    from advisor.hardware import get_hardware
    from advisor.peaks import default_peaks
    from advisor.settings import get_settings

    if ":" in workload or options is None or options.calibrate is not False:
        return None
    return (workload, json.dumps(workload_args or {}, sort_keys=True, default=str),
            (get_hardware(hardware) if isinstance(hardware, str) else hardware).model_dump_json(),
            request.model_dump_json() if request is not None else None, options.model_dump_json(),
            get_settings().model_dump_json(), default_peaks().version(), tuple(sorted(os.environ.items())))


def estimate_layout(workload: str, hardware: "HardwareSpec | str", layout: Any,
                    request: "EstimateRequest | None" = None, *, workload_args: dict[str, Any] | None = None,
                    timeout_s: float | None = None, memory_cap_bytes: int | None = None,
                    pool: WorkerPool | None = None, **options: Any) -> Any:
    """advisor.estimate.parallel.estimate_layout (`options`: its keyword arguments, e.g. margin, method) in an
    isolated worker: it builds and traces the workload."""
    from advisor.estimate.parallel import estimate_layout as estimate_parallel

    return run_isolated(estimate_parallel, workload, hardware, layout, request, workload_args=workload_args,
                        spec=workload, what="the estimate", stage=f"loading {workload}", timeout_s=timeout_s,
                        memory_cap_bytes=memory_cap_bytes, pool=pool, **options)


def describe(spec: str, args: dict[str, Any] | None = None, *, timeout_s: float | None = None,
             memory_cap_bytes: int | None = None, pool: WorkerPool | None = None) -> "WorkloadInfo":
    """The workload's name, fingerprint and attributes (advisor.workload.describe_workload), isolated."""
    from advisor.workload import describe_workload

    return run_isolated(describe_workload, spec, dict(args or {}), spec=spec, what="loading the workload",
                        stage=f"loading {spec}", timeout_s=timeout_s, memory_cap_bytes=memory_cap_bytes, pool=pool)

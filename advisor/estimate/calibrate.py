"""Short real runs on this CPU that refine the estimate (allowed only when the target is here).

Two batch sizes well below the one asked for are run for real (advisor.measure: a fresh process
each, DESIGN.md's protocol). What the process holds beyond the heap model of the traced
allocations is fitted as affine in batch size; so is what kernels allocate that tracing cannot
see (e.g. oneDNN RNN workspaces). The same runs stand in for the trace of a model that cannot be
traced.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from advisor.estimate.batchmodel import BatchModel
from advisor.estimate.heap import simulate
from advisor.estimate.model import EstimateRequest
from advisor.estimate.overhead import CpuCalibration
from advisor.estimate.trace import PARAMS, TEMPORARIES, Trace
from advisor.measure import MeasureRequest, MeasureResult, measure


@dataclass(frozen=True)
class Calibration(CpuCalibration):
    batches: tuple[int, ...] = ()


def calibration_batches(batch: int) -> tuple[int, int]:
    """Two batch sizes at most a quarter of `batch` (samples), distinct where possible."""
    hi = max(1, batch // 4)
    lo = max(1, hi // 2)
    return (lo, hi) if lo < hi else (hi, hi + 1) if batch > 1 else (1, 2)


def _run_all(spec: str, args: dict[str, Any], req: EstimateRequest, batches: tuple[int, ...], modes: tuple[str, ...]) -> dict:
    jobs = {(b, m): MeasureRequest(workload=spec, workload_args=args, batch_size=b, precision=req.precision,
                                   optimizer=req.optimizer, checkpointing=req.checkpointing,
                                   fused_backward=req.fused_backward, mode=m)
            for b in batches for m in modes}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {k: pool.submit(measure, j) for k, j in jobs.items()}
        return {k: f.result() for k, f in futures.items()}


def _affine(xs: list[int], ys: list[float]) -> tuple[float, float]:
    if len(set(xs)) < 2:
        return float(ys[0]), 0.0
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(intercept), float(max(slope, 0.0))


def calibrate_cpu(spec: str, args: dict[str, Any], req: EstimateRequest, bm: BatchModel) -> Calibration:
    batches = calibration_batches(req.batch_size)
    res: dict[tuple[int, str], MeasureResult] = _run_all(spec, args, req, batches, ("rss", "alloc"))
    xs, runtime, hidden = [], [], []
    for b in batches:
        tr = bm.at(b)
        real_alloc = res[(b, "alloc")].alloc_peak_bytes or 0
        hid = max(0, real_alloc - tr.peak_bytes)
        heap = simulate(tr.sizes, tr.ids)
        xs.append(b)
        hidden.append(hid)
        runtime.append(res[(b, "rss")].rss_delta_bytes - heap - hid)
    ri, rs = _affine(xs, runtime)
    hi_, hs = _affine(xs, hidden)
    return Calibration(intercept=ri, per_sample=rs, alloc_intercept=hi_, alloc_per_sample=hs, batches=batches)


def _measured_trace(param_bytes: int, alloc: int) -> Trace:
    curve = np.zeros((1, 7), dtype=np.int64)
    curve[0, PARAMS] = param_bytes
    curve[0, TEMPORARIES] = max(0, alloc - param_bytes)
    return Trace(curve=curve, sizes=np.asarray([alloc], np.int64), ids=np.asarray([0], np.int64), phases=[(0, "measured")],
                 param_bytes=param_bytes, grad_bytes=param_bytes, opt_state_bytes=0, largest_block_bytes=0,
                 flops_per_step=0, num_params=0, seconds=0.0)


def measured_batch_model(name: str, spec: Any, args: dict[str, Any] | None, req: EstimateRequest) -> BatchModel:
    """A BatchModel from real allocated peaks at two small batches, for models tracing cannot run."""
    import torch

    from advisor.errors import EstimateError
    from advisor.workload import load_workload

    if not isinstance(spec, str):
        raise EstimateError(f"{name} cannot be traced and was given as an object, so no fresh process can run it")
    wl = load_workload(spec, args)
    model = wl.build_model()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    num_params = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    lo, hi = 1, 2
    res = _run_all(spec, args or {}, req, (lo, hi), ("alloc",))
    ta = _measured_trace(param_bytes, res[(lo, "alloc")].alloc_peak_bytes or 0)
    tc = _measured_trace(param_bytes, res[(hi, "alloc")].alloc_peak_bytes or 0)
    from dataclasses import replace

    return BatchModel(a=lo, trace_a=replace(ta, num_params=num_params), c=hi, trace_c=replace(tc, num_params=num_params))

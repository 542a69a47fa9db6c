"""estimate_memory: workload + hardware + request -> MemoryEstimate (per device)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from advisor.config import Strategy
from advisor.errors import EstimateError, SpecError
from advisor.estimate.batchmodel import BatchModel
from advisor.estimate.cuda_reduce import ReduceGpu
from advisor.estimate.evaluator import Evaluator
from advisor.estimate.largest import largest_batches
from advisor.estimate.model import Breakdown, Case, EstimateOptions, EstimateRequest, Fitted, MemoryEstimate
from advisor.estimate.notes import exact_largest_reason, trace_notes
from advisor.estimate.refine import refine
from advisor.estimate.resident.measured import resident_fit
from advisor.estimate.roofline import step_time
from advisor.estimate.stages import report
from advisor.estimate.trace import Trace, trace_training
from advisor.fingerprint import workload_fingerprint
from advisor.hardware.spec import HardwareSpec
from advisor.workload import Workload

# Traces of preset steps kept in this process (a tuner's isolated worker estimates batch after batch; the batch
# model traces each at b and 2b or b/2): gpt2-small's is 0.5 MB pickled, tiny-gpt2's 0.1 MB.
TRACES_KEPT = 32
_TRACES: collections.OrderedDict[tuple, Trace] = collections.OrderedDict()
_TRACES_LOCK = threading.Lock()

if TYPE_CHECKING:
    from advisor.estimate.resident.calibration import Run


def estimate_memory(workload: Workload | str, hardware: HardwareSpec | str, request: EstimateRequest | None = None,
                    options: EstimateOptions | None = None, *,
                    workload_args: dict[str, Any] | None = None) -> MemoryEstimate:
    """Predict per-device peak memory of a training step, whether it fits, and the largest batch.

    `workload`: a preset name, path/to/file.py:build or pkg.module:build (built with `workload_args`), or a
    Workload object (which no fresh process can run: no calibration). `hardware`: a catalog name[:devices],
    'cpu', 'local', or a HardwareSpec. `request`: the configuration (default: every knob's default, at the
    workload's batch). `options`: how to estimate (EstimateOptions' defaults). Raises SpecError for input
    that is not valid (an unknown preset, a sharded strategy on one device), EstimateError where the
    workload cannot be estimated.
    """
    return estimate_fitted(workload, hardware, request, options, workload_args=workload_args)[0]


def estimate_fitted(workload: Workload | str, hardware: HardwareSpec | str, request: EstimateRequest | None = None,
                    options: EstimateOptions | None = None, *,
                    workload_args: dict[str, Any] | None = None) -> tuple[MemoryEstimate, Evaluator]:
    """estimate_memory's answer, and the evaluator it rests on: `Evaluator.total(b)` gives the request's
    per-device bytes at any batch size b without tracing again (curve.py)."""
    t0 = time.perf_counter()
    case = _case(workload, hardware, request, options or EstimateOptions(), workload_args)
    hw, req, batch = case.hw, case.req, case.req.batch_size
    notes: list[str] = [hw.note] if hw.note else []
    usable = int(hw.memory_per_device_bytes * (1 - _margin(case.options)))
    calibrating = _calibrating(case.options)
    probe_gpu = calibrating is True and _local_cuda(hw)
    reduce_gpu = _reduce_gpu(hw, probe_gpu)
    report(f"tracing {case.wl.name} at batch {batch}")
    bm, used = _choose_batch_model(case, notes, probe_gpu, reduce_gpu)
    notes += trace_notes(bm.trace_a, case.wl.name, hw, reduce_gpu)
    fit = _fit(case, bm, bool(calibrating) and used != "analytic", notes)
    tr, _, parts, ov = fit.ev.at(batch, runs=True)
    total, runtime = fit.ev.total(batch, runs=True)
    breakdown = _breakdown(parts, total)
    fits = total + runtime <= usable
    if not fits and case.options.line and bm.a != batch and used == "traced":  # off the line: decided on its own trace
        return estimate_fitted(workload, hardware, request, case.options.model_copy(update={"line": False}),
                               workload_args=workload_args)
    own = req.strategy.value
    if case.options.largest:
        by_strategy = _largest(case, fit, usable, probe_gpu, notes)
    else:
        by_strategy = {}
        notes.append(f"largest batch not asked for: the step traced at batch {batch} only" if bm.a == batch else
                     f"largest batch not asked for: batch {batch} read off the line through the step's traces at "
                     f"{bm.a} and {bm.c}, kept in this process (their allocations align), not traced")
    if not fits and by_strategy.get(own, -1) >= batch:  # real runs at the batch outweigh the line there
        notes.append(f"largest batch {by_strategy[own]} -> {batch - 1}: the real runs at batch {batch} say it does "
                     "not fit")
        by_strategy[own] = batch - 1
    step_s, samples_s = _roofline(hw, req, tr, breakdown.activations, notes)
    answer = MemoryEstimate(
        workload=case.wl.name, hardware=hw.accelerator.name, request=req, world_size=hw.world_size,
        predicts=_predicts(hw), total_bytes=total, allocated_bytes=ov.allocated, breakdown=breakdown,
        runtime_bytes=runtime, device_memory_bytes=hw.memory_per_device_bytes, usable_bytes=usable, fits=fits,
        max_batch_size=by_strategy.get(own), max_batch_by_strategy=by_strategy, method=used,
        calibrated=fit.calibrated, refined_by=len(fit.points), num_params=tr.num_params,
        flops_per_step=tr.flops_per_step, predicted_step_s=step_s, predicted_samples_per_s=samples_s, notes=notes,
        seconds=time.perf_counter() - t0)
    return answer, fit.ev


def _resolve(workload: Workload | str, hardware: HardwareSpec | str, workload_args: dict[str, Any] | None):
    from advisor.hardware import get_hardware
    from advisor.workload import load_workload

    wl = load_workload(workload, workload_args) if isinstance(workload, str) else workload
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    return wl, hw


def _case(workload: Workload | str, hardware: HardwareSpec | str, request: EstimateRequest | None,
          options: EstimateOptions, workload_args: dict[str, Any] | None) -> Case:
    """The inputs resolved: the workload built, the hardware looked up, the request's batch size named
    (the workload's where it names none) and checked against the hardware."""
    wl, hw = _resolve(workload, hardware, workload_args)
    req = request if request is not None else EstimateRequest()
    if req.batch_size is None:
        req = req.model_copy(update={"batch_size": wl.default_batch_size})
    if req.strategy != Strategy.single and hw.world_size < 2:
        raise SpecError(f"strategy {req.strategy.value} needs 2+ devices; give e.g. --hardware {hw.accelerator.name}:8")
    # the calibration cache and the measured peaks both key on it; it builds the model on meta: once
    fingerprint = functools.cache(functools.partial(workload_fingerprint, wl))
    return Case(workload, workload_args, wl, hw, req, options, fingerprint)


def _margin(options: EstimateOptions) -> float:
    from advisor.settings import get_settings

    return get_settings().memory_margin if options.margin is None else options.margin


def _calibrating(options: EstimateOptions) -> bool | str:
    from advisor.settings import get_settings

    return get_settings().calibrate if options.calibrate is None else options.calibrate


def _predicts(hw: HardwareSpec) -> str:
    return "cpu_rss" if hw.device_type == "cpu" else "cuda_reserved"


def _trace_impl(req: EstimateRequest, device_type: str) -> str | None:
    """The optimizer implementation the target runs. The trace runs on the CPU, where torch's default
    is the per-parameter loop; on CUDA its default is foreach, whose ops allocate every parameter's
    intermediate at once (one extra copy of the parameters or more at the step's peak)."""
    if req.optimizer_impl is None and device_type == "cuda":
        return "foreach"
    return req.optimizer_impl


def _local_cuda(hw: HardwareSpec) -> bool:
    """Whether the target is this machine's GPU and torch can reach it (its kernels' workspaces can
    then be sized for real, as a CPU target's are)."""
    if hw.device_type != "cuda" or not hw.is_local:
        return False
    import torch

    return torch.cuda.is_available()


def _local_cpu(hw: HardwareSpec) -> bool:
    """Whether the target is this machine's CPU (its kernels' scratch can then be sized for real)."""
    return hw.device_type == "cpu" and hw.is_local


def _reduce_gpu(hw: HardwareSpec, probe_gpu: bool) -> ReduceGpu | None:
    """The GPU whose launch rules size reductions' cross-block scratch, where no GPU measures it."""
    if hw.device_type != "cuda" or probe_gpu:
        return None
    return ReduceGpu.on_device() if _local_cuda(hw) else ReduceGpu.of(hw.accelerator)


def _kept(key: tuple | None) -> dict[int, Trace]:
    """Batch size -> this step's trace, of the traces kept in this process."""
    if key is None:
        return {}
    with _TRACES_LOCK:
        return {b: t for (k, b), t in _TRACES.items() if k == key}


def _line_model(b: int, kept: dict[int, Trace], cpu_uncalibrated: bool,
                tracer: Callable[[int], Trace]) -> BatchModel | None:
    """A batch model through two kept traces of the step at other batches, from which batch b is read without a
    trace: the line the largest batch is solved on (batchmodel.py). The nearest on each side of b where there
    are, else the two nearest, batch 1 neither. None where b is 1 or kept itself, fewer than two are, their
    allocations do not align, or a kernel's scratch in them is not affine in the batch (exact_largest_reason)."""
    kept = {x: t for x, t in kept.items() if x > 1}  # batch 1 may take other kernels' paths (`_batch_model`)
    if b == 1 or b in kept or len(kept) < 2:
        return None
    order = sorted(kept)
    below, above = [x for x in order if x < b], [x for x in order if x > b]
    a, c = (below[-1], above[0]) if below and above else sorted(sorted(kept, key=lambda x: abs(x - b))[:2])
    if any(exact_largest_reason(kept[x], cpu_uncalibrated) for x in (a, c)):
        return None
    bm = BatchModel(a=a, trace_a=kept[a], c=c, trace_c=kept[c], tracer=tracer)
    return bm if bm.aligned is not None else None


def _tracer(wl: Workload, req: EstimateRequest, cpu: bool, device_type: str = "cpu",
            cuda: bool = False, reduce_gpu: ReduceGpu | None = None, *,
            preset: tuple[str, str] | None = None) -> tuple[Callable[..., Trace], Callable[[], dict[int, Trace]]]:
    """(trace(b, flops=True): the request's training step traced at batch b, kept(): batch size -> this step's
    traces kept in this process). `preset` ((name, its arguments as JSON) where the workload is a preset, whose
    code cannot change under this process): traces are kept (TRACES_KEPT) and given again to any estimate that
    asks for the same step at the same batch; other steps' are not kept."""
    import torch

    kw = dict(precision=req.precision, optimizer=req.optimizer, checkpointing=req.checkpointing,
              fused_backward=req.fused_backward, optimizer_impl=_trace_impl(req, device_type), cpu_workspaces=cpu,
              cuda_workspaces=cuda, device=device_type, reduce_gpu=reduce_gpu)
    # kernels sized on this GPU may size otherwise as its free memory changes; the CPU's scratch by thread count
    key = None if preset is None or cuda else (preset, repr(sorted(kw.items())), torch.get_num_threads())

    def retrace(b: int, flops: bool = True) -> Trace:
        if key is None:
            return trace_training(wl, b, count_flops=flops, **kw)
        with _TRACES_LOCK:
            trace = _TRACES.get((key, b))
            if trace is not None:
                _TRACES.move_to_end((key, b))
        if trace is None:
            # traced counting FLOPs whoever asks, so one trace serves both (counting them costs no measurable time)
            trace = trace_training(wl, b, count_flops=True, **kw)
            for value in vars(trace).values():  # shared from now on: a caller writing into it would change others'
                if isinstance(value, np.ndarray):
                    value.flags.writeable = False
            with _TRACES_LOCK:
                _TRACES[(key, b)] = trace
                while len(_TRACES) > TRACES_KEPT:
                    _TRACES.popitem(last=False)
        return trace if flops else dataclasses.replace(trace, flops_per_step=0)

    return retrace, lambda: _kept(key)


def _preset(case: Case) -> tuple[str, str] | None:
    """(name, arguments as JSON) of a preset workload; None for a file, module or object (which may change)."""
    if not isinstance(case.workload, str) or ":" in case.workload:
        return None
    return case.workload, json.dumps(case.workload_args or {}, sort_keys=True, default=str)


def _batch_model(wl: Workload, req: EstimateRequest, cpu: bool, device_type: str = "cpu", cuda: bool = False,
                 reduce_gpu: ReduceGpu | None = None, preset: tuple[str, str] | None = None,
                 largest: bool = True, line: bool = False) -> BatchModel:
    """The batch model of the request's step: traces at its batch and at 2x or half of it (the line the largest
    batch is solved on), or, without `largest`, at its batch alone (any other batch is traced on its own); with
    `line` too, the line through two kept traces of the step at other batches where there is one (`_line_model`:
    `cpu`, this CPU is the target and is not calibrated)."""
    retrace, kept = _tracer(wl, req, cpu, device_type, cuda, reduce_gpu, preset=preset)

    a = req.batch_size
    if not largest and line:
        bm = _line_model(a, kept(), cpu, lambda b: retrace(b, False))
        if bm is not None:
            return bm
    if not largest:
        return BatchModel(a=a, trace_a=retrace(a), retrace=lambda b: retrace(b, False),
                          tracer=lambda b: retrace(b, False))
    if a == 1:
        # Batch 1 often takes other kernels' paths (e.g. matmuls folded differently) than larger
        # batches, so it is traced exactly and the batch scaling comes from traces at 2 and 4.
        return BatchModel(a=2, trace_a=retrace(2), c=4, trace_c=retrace(4, False), exact={1: retrace(1)},
                          tracer=lambda b: retrace(b, False))
    c = a * 2 if a < 4 else a // 2
    return BatchModel(a=a, trace_a=retrace(a), c=c, trace_c=retrace(c, False), tracer=lambda b: retrace(b, False))


def _choose_batch_model(case: Case, notes: list[str], cuda: bool,
                        reduce_gpu: ReduceGpu | None) -> tuple[BatchModel, str]:
    """Formulas, a fake-tensor trace, or (untraceable model) real-tensor traces at batch 1 and 2."""
    from advisor.settings import get_settings

    wl, req, method = case.wl, case.req, case.options.method
    limit = get_settings().trace_param_limit
    if method == "analytic" or (method == "auto" and wl.decoder is not None and _decoder_params(wl) > limit):
        from advisor.estimate.analytic import analytic_trace

        notes.append("analytic: per-layer decoder formulas (Korthikanti et al. 2022); model too large to trace quickly")
        return BatchModel(a=req.batch_size, trace_a=analytic_trace(wl, req.batch_size, req),
                          retrace=lambda b: analytic_trace(wl, b, req)), "analytic"
    try:
        return _batch_model(wl, req, _local_cpu(case.hw), case.hw.device_type, cuda, reduce_gpu,
                            _preset(case), case.options.largest,
                            case.options.line and _calibrating(case.options) is False), "traced"
    except EstimateError as exc:
        if not isinstance(case.workload, str):
            raise EstimateError(f"{exc}; a workload passed as an object cannot be run in a fresh process, "
                                "so give its preset name or file.py:build to fall back to real steps") from exc
        if case.options.calibrate == "kept":
            raise EstimateError(f"{exc}; its fallback, real steps at batch 1 and 2, is not run for this caller "
                                "(`advisor estimate` here runs it)") from exc
        from advisor.estimate.resident.calibrate import real_batch_model

        notes.append(f"{exc}; fell back to real steps at batch 1 and 2 on this CPU, traced on real tensors")
        bm, _ = real_batch_model(case.workload, case.workload_args or {}, req, (1, 2))
        return bm, "measured"


def _decoder_params(wl: Workload) -> int:
    from advisor.estimate.analytic import decoder_param_count

    return decoder_param_count(wl.decoder)


def _fit(case: Case, bm: BatchModel, calibrate: bool, notes: list[str]) -> Fitted:
    """The evaluator at the request, fitted with what was measured of it: on a CPU the resident-set model's
    calibration and measured peaks (resident/measured.py), on a GPU the measured peaks' refinement (refine.py)."""
    stored = functools.partial(_measured_points, case, _predicts(case.hw))
    if case.hw.device_type == "cpu":
        return resident_fit(case, bm, calibrate, stored, notes)
    ev = Evaluator(case.hw, case.req, bm, None)
    points = stored() if case.options.measured else []
    if points:
        ev.refined = refine([(b, peak) for b, peak, _ in points], ev.predicted_total)
        notes.append(ev.refined.note())
    return Fitted(ev, points)


def _measured_points(case: Case, predicts: str) -> list[Run]:
    """The store I/O at the estimator's edge: (batch size, peak bytes, the glibc mmap threshold the run
    fixed or None) of this configuration's measured peaks. A CPU's measured resident sets describe
    only the host they ran on, so a CPU target uses them only when it is this machine; a GPU's carry
    over to devices of the same catalog model."""
    from advisor.peaks import default_peaks, request_key

    hw, measured = case.hw, case.options.measured
    if hw.device_type == "cpu" and not hw.is_local:
        return []
    store = default_peaks() if measured is True else measured
    if not store.may_hold_points():
        return []
    key = request_key(case.fingerprint(), hw, case.req, case.options.compile_mode, predicts)
    return [(p.batch_size, p.peak_bytes, p.mmap_threshold) for p in store.points(key)]


def _breakdown(parts: dict[str, int], total: int) -> Breakdown:
    """The parts at the peak, with what tensors do not account for of `total` as overhead (never below 0)."""
    parts["overhead"] = total - sum(parts.values())
    if parts["overhead"] < 0:
        parts["temporaries"] += parts["overhead"]
        parts["overhead"] = 0
    return Breakdown(**parts)


def _largest(case: Case, fit: Fitted, usable: int, probe_gpu: bool, notes: list[str]) -> dict[str, int]:
    """The largest batch per strategy (largest.py), searched again on exact traces where kernels' scratch
    is not affine in the batch (notes.exact_largest_reason) and the options ask for it."""
    hw, ev = case.hw, fit.ev
    exact = exact_largest_reason(ev.bm.trace_a, _local_cpu(hw) and not fit.calibrated)
    if exact and not case.options.exact_largest:
        notes.append(f"largest batch from the traces' line, not searched again on exact traces ({exact}): "
                     "not asked for")
        exact = None
    trace_at = _tracer(case.wl, case.req, _local_cpu(hw), hw.device_type, probe_gpu,
                       preset=_preset(case))[0] if exact else None
    kept = case.options.calibrate == "kept"  # a caller that allows no real runs
    if kept and fit.calibrated:
        notes.append("largest batch from the kept calibration's fit, not checked with real runs near it (none are "
                     "made for this caller)")
    return largest_batches(ev, fit.calibrated, fit.points, None if kept else case.workload, case.workload_args,
                           usable, notes, fit.record, trace_at, exact or "")


def _roofline(hw: HardwareSpec, req: EstimateRequest, tr: Trace, activations: int,
              notes: list[str]) -> tuple[float | None, float | None]:
    """(seconds per step, samples per second) by the roofline, or (None, None) with a note where it has none."""
    moved = tr.param_bytes * 3 + tr.opt_state_bytes * 2 + activations * 2
    try:
        step_s = step_time(hw, req.precision, tr.flops_per_step, moved)
    except ValueError as exc:
        notes.append(f"no roofline: {exc}")
        return None, None
    return step_s, (req.batch_size * hw.world_size / step_s if step_s > 0 else None)

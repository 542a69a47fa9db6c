"""estimate_memory: workload + hardware + configuration -> MemoryEstimate (per device)."""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from advisor.config import OptimizerKind, Precision, Strategy
from advisor.errors import EstimateError, SpecError
from advisor.estimate.batchmodel import BatchModel
from advisor.estimate.model import Breakdown, EstimateRequest, MemoryEstimate
from advisor.estimate.cuda_alloc import cublas_workspace_bytes
from advisor.estimate.overhead import CpuCalibration, Overhead, cpu_overhead, cuda_overhead
from advisor.estimate.refine import CAUTION, Refinement, cautious, refine, resident_note
from advisor.estimate.roofline import step_time
from advisor.estimate.strategy import heap_and_mapped, peak_breakdown, scaled_curve, touched_peak
from advisor.estimate.trace import Trace, trace_training
from advisor.fingerprint import workload_fingerprint
from advisor.hardware.spec import HardwareSpec
from advisor.workload import Workload

if TYPE_CHECKING:
    from advisor.peaks import MeasuredPeaks

log = logging.getLogger(__name__)
MAX_BATCH_LIMIT = 1 << 22  # samples: the search stops here
# A second calibration round at the predicted largest batch (twice) and half of it runs only when
# the predicted resident set at the largest is at most this share of this host's memory (two runs
# go at once): cheap runs, no risk to the host. Asked about this host's own memory, the largest batch
# is about all of it, so the common `estimate` on the local CPU never pays for the round.
RECALIBRATE_HOST_SHARE = 0.3
# Another round runs where the re-solved answer moved more than this share away from the batch the
# round ran at, up to NEAR_ROUNDS rounds in all.
NEAR, NEAR_ROUNDS = 0.1, 3
# ... and never this many times past the largest batch already run. The host-share bound above
# trusts the batch model being checked; this one does not: a model that barely grows (it happened,
# bf16 traces whose frees came in another order, fixed in batchmodel.py) would send a real run to
# a batch that takes the host's memory.
NEAR_REACH = 64


def _resolve(workload: Workload | str, hardware: HardwareSpec | str, workload_args: dict[str, Any] | None):
    from advisor.hardware import get_hardware
    from advisor.workload import load_workload

    wl = load_workload(workload, workload_args) if isinstance(workload, str) else workload
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    return wl, hw


class _Evaluator:
    """Totals for one (workload, hardware, request) at any batch size."""

    def __init__(self, hw: HardwareSpec, req: EstimateRequest, bm: BatchModel, calib: CpuCalibration | None):
        self.hw, self.req, self.bm, self.calib = hw, req, bm, calib
        # CUDA: measured peaks of req's configuration (refine.py); a CPU's join `calib` instead
        self.refined: Refinement | None = None

    def at(self, b: int, strategy: Strategy | None = None) -> tuple[Trace, int, dict[str, int], Overhead]:
        req = self.req if strategy is None else self.req.model_copy(update={"strategy": strategy})
        tr = self.bm.at(b)
        curve = scaled_curve(req, tr, self.hw.world_size)
        allocated, parts = peak_breakdown(curve)
        if self.hw.device_type == "cpu":
            persistent, heap, mapped, hidden = self._cpu_terms(curve, tr)
            allocated += hidden  # kernels' own buffers, seen only by real runs: counted as temporaries
            parts["temporaries"] += hidden
            ov = cpu_overhead(allocated, persistent, heap + hidden, self.calib, mapped,
                              floor=touched_peak(curve, tr.untouched) + hidden)
        else:
            workspace = cublas_workspace_bytes(self.hw.accelerator.name)
            ov = cuda_overhead(tr, allocated, workspace)
            allocated += workspace
            parts["temporaries"] += workspace
        return tr, allocated, parts, ov

    def _cpu_terms(self, curve, tr: Trace) -> tuple[int, int, int, int]:
        """(persistent peak, heap-served transient peak, mapped transient peak, kernels' hidden buffers)
        of a CPU curve (bytes): what the resident-set model takes."""
        persistent, heap, mapped = heap_and_mapped(curve, tr.synthetic, tr.untouched)
        return persistent, heap, mapped, (self.calib.hidden(heap + mapped) if self.calib else 0)

    def transient(self, b: int) -> int:
        """CPU: the transient bytes the resident-set slope multiplies at batch b (heap-served ones plus
        kernels' hidden buffers, as in `at`)."""
        tr = self.bm.at(b)
        _, heap, _, hidden = self._cpu_terms(scaled_curve(self.req, tr, self.hw.world_size), tr)
        return heap + hidden

    def predicted_total(self, b: int) -> int:
        """The estimator's own total for the request at batch b (bytes), before measured peaks."""
        return self.at(b)[3].total

    def total(self, b: int, strategy: Strategy | None = None) -> tuple[int, int]:
        """(total, runtime) at batch b (bytes); measured peaks refine the request's own strategy only."""
        _, _, _, ov = self.at(b, strategy)
        if self.refined is not None and strategy in (None, self.req.strategy):
            return self.refined.total(b, self.predicted_total), ov.runtime
        return ov.total, ov.runtime

    def device_bytes(self, b: int, strategy: Strategy | None = None) -> int:
        return sum(self.total(b, strategy))

    def max_batch(self, usable: int, strategy: Strategy | None = None) -> int:
        """The largest batch whose total fits `usable`, a calibration's run-to-run spread kept clear."""
        usable -= int(self.calib.spread) if self.calib is not None and self.refined is None else 0
        if self.device_bytes(1, strategy) > usable:
            return 0
        lo, hi = 1, 2
        while hi < MAX_BATCH_LIMIT and self.device_bytes(hi, strategy) <= usable:
            lo, hi = hi, hi * 2
        if hi >= MAX_BATCH_LIMIT:
            return lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.device_bytes(mid, strategy) <= usable:
                lo = mid
            else:
                hi = mid
        return lo


def _strategies(hw: HardwareSpec) -> list[Strategy]:
    return [Strategy.single] if hw.world_size == 1 else list(Strategy)


def _trace_impl(req: EstimateRequest, device_type: str) -> str | None:
    """The optimizer implementation the target runs. The trace runs on the CPU, where torch's default
    is the per-parameter loop; on CUDA its default is foreach, whose ops allocate every parameter's
    intermediate at once (one extra copy of the parameters or more at the step's peak)."""
    if req.optimizer_impl is None and device_type == "cuda":
        return "foreach"
    return req.optimizer_impl


def _batch_model(wl: Workload, req: EstimateRequest, cpu: bool, device_type: str = "cpu") -> BatchModel:
    kw = dict(precision=req.precision, optimizer=req.optimizer, checkpointing=req.checkpointing,
              fused_backward=req.fused_backward, optimizer_impl=_trace_impl(req, device_type), cpu_workspaces=cpu)

    def retrace(b: int, flops: bool = True) -> Trace:
        return trace_training(wl, b, count_flops=flops, **kw)

    a = req.batch_size
    if a == 1:
        # Batch 1 often takes other kernels' paths (e.g. matmuls folded differently) than larger
        # batches, so it is traced exactly and the batch scaling comes from traces at 2 and 4.
        return BatchModel(a=2, trace_a=retrace(2), c=4, trace_c=retrace(4, False), exact={1: retrace(1)})
    c = a * 2 if a < 4 else a // 2
    return BatchModel(a=a, trace_a=retrace(a), c=c, trace_c=retrace(c, False))


def estimate_memory(workload: Workload | str, hardware: HardwareSpec | str, batch_size: int | None = None, *,
                    precision: Precision | str = Precision.fp32, optimizer: OptimizerKind | str = OptimizerKind.adamw,
                    strategy: Strategy | str = Strategy.single, checkpointing: bool = False, fused_backward: bool = False,
                    offload_optimizer: bool = False, offload_params: bool = False, optimizer_impl: str | None = None,
                    workload_args: dict[str, Any] | None = None, calibrate: bool | None = None,
                    margin: float | None = None, method: str = "auto", measured: bool | MeasuredPeaks = True,
                    compile_mode: str = "none") -> MemoryEstimate:
    """Predict per-device peak memory of a training step, whether it fits, and the largest batch.

    `method`: 'traced' (fake-tensor trace), 'analytic' (decoder formulas), or 'auto' (analytic
    for decoders above settings.trace_param_limit parameters, else traced). `calibrate`: allow
    a short real run at small batches when the target is this machine's CPU (default: settings).
    `measured`: refine with measured peaks of the same workload fingerprint, device and knobs
    (`compile_mode` among them) from the default store (True), the given store, or not (False).
    """
    from advisor.settings import get_settings

    t0 = time.perf_counter()
    wl, hw = _resolve(workload, hardware, workload_args)
    batch = wl.default_batch_size if batch_size is None else batch_size
    req = _make_request(hw, batch, precision=precision, optimizer=optimizer, strategy=strategy,
                        checkpointing=checkpointing, fused_backward=fused_backward, offload_optimizer=offload_optimizer,
                        offload_params=offload_params, optimizer_impl=optimizer_impl)
    notes: list[str] = [hw.note] if hw.note else []
    margin = get_settings().memory_margin if margin is None else margin
    usable = int(hw.memory_per_device_bytes * (1 - margin))

    bm, used = _choose_batch_model(wl, workload, workload_args, req, method, notes,
                                   cpu=hw.device_type == "cpu" and hw.is_local, device_type=hw.device_type)
    if bm.trace_a.sized_kernels:
        notes.append(f"kernel scratch and workspaces sized by running {bm.trace_a.sized_kernels} oneDNN op shape(s) "
                     "once on zeros on this CPU (fake ops report none)")
    # the calibration cache and the measured peaks both key on it; it builds the model on meta: once
    fingerprint = functools.cache(functools.partial(workload_fingerprint, wl))
    calib = None
    do_cal = get_settings().calibrate if calibrate is None else calibrate
    if hw.device_type == "cpu" and hw.is_local and do_cal and used != "analytic":
        calib, bm = _calibrate(fingerprint, workload, workload_args, req, bm, notes)

    ev = _Evaluator(hw, req, bm, calib)
    predicts = "cpu_rss" if hw.device_type == "cpu" else "cuda_reserved"
    points = _measured_points(fingerprint, hw, req, compile_mode, predicts, measured) if measured else []
    if points:
        ev = _measured_refinement(ev, points, notes)
    tr, allocated, parts, ov = ev.at(batch)
    total, _ = ev.total(batch)
    parts["overhead"] = total - sum(parts.values())
    if parts["overhead"] < 0:
        parts["temporaries"] += parts["overhead"]
        parts["overhead"] = 0
    fits = total + ov.runtime <= usable
    by_strategy = _largest_batches(ev, calib is not None, points, workload, workload_args, usable, notes)
    step_s = samples_s = None
    moved = tr.param_bytes * 3 + tr.opt_state_bytes * 2 + parts["activations"] * 2
    try:
        step_s = step_time(hw, req.precision, tr.flops_per_step, moved)
        samples_s = batch * hw.world_size / step_s if step_s > 0 else None
    except ValueError as exc:
        notes.append(f"no roofline: {exc}")
    return MemoryEstimate(
        workload=wl.name, hardware=hw.accelerator.name, request=req, world_size=hw.world_size, predicts=predicts,
        total_bytes=total, allocated_bytes=ov.allocated, breakdown=Breakdown(**parts), runtime_bytes=ov.runtime,
        device_memory_bytes=hw.memory_per_device_bytes, usable_bytes=usable, fits=fits,
        max_batch_size=by_strategy[req.strategy.value], max_batch_by_strategy=by_strategy,
        method=used, calibrated=calib is not None, refined_by=len(points), num_params=tr.num_params, flops_per_step=tr.flops_per_step,
        predicted_step_s=step_s, predicted_samples_per_s=samples_s, notes=notes, seconds=time.perf_counter() - t0)


def _make_request(hw: HardwareSpec, batch: int, **knobs: Any) -> EstimateRequest:
    """The typed request, or a one-line SpecError saying what is wrong."""
    if batch <= 0:
        raise SpecError(f"batch size must be a positive integer, got {batch}")
    try:
        req = EstimateRequest(batch_size=batch, precision=Precision(knobs.pop("precision")),
                              optimizer=OptimizerKind(knobs.pop("optimizer")), strategy=Strategy(knobs.pop("strategy")),
                              **knobs)
    except ValueError as exc:
        raise SpecError(str(exc).splitlines()[-1] if "validation error" in str(exc) else str(exc)) from exc
    if req.strategy != Strategy.single and hw.world_size < 2:
        raise SpecError(f"strategy {req.strategy.value} needs 2+ devices; give e.g. --hardware {hw.accelerator.name}:8")
    return req


def _choose_batch_model(wl: Workload, workload: Workload | str, workload_args: dict[str, Any] | None,
                        req: EstimateRequest, method: str, notes: list[str], cpu: bool,
                        device_type: str = "cpu") -> tuple[BatchModel, str]:
    """Formulas, a fake-tensor trace, or (untraceable model) real-tensor traces at batch 1 and 2."""
    from advisor.settings import get_settings

    limit = get_settings().trace_param_limit
    if method == "analytic" or (method == "auto" and wl.decoder is not None and _decoder_params(wl) > limit):
        from advisor.estimate.analytic import analytic_trace

        notes.append("analytic: per-layer decoder formulas (Korthikanti et al. 2022); model too large to trace quickly")
        return BatchModel(a=req.batch_size, trace_a=analytic_trace(wl, req.batch_size, req),
                          retrace=lambda b: analytic_trace(wl, b, req)), "analytic"
    try:
        return _batch_model(wl, req, cpu, device_type), "traced"
    except EstimateError as exc:
        if not isinstance(workload, str):
            raise EstimateError(f"{exc}; a workload passed as an object cannot be run in a fresh process, "
                                "so give its preset name or file.py:build to fall back to real steps") from exc
        from advisor.estimate.calibrate import real_batch_model

        notes.append(f"{exc}; fell back to real steps at batch 1 and 2 on this CPU, traced on real tensors")
        bm, _ = real_batch_model(workload, workload_args or {}, req, (1, 2))
        return bm, "measured"


# Calibrations done in this process, by workload and request: a second estimate of the same request
# (the API asked again, the tuner pruning, a before/after comparison) reuses the runs rather than
# repeating them and answering differently by their noise. Bounded: the oldest goes first.
_CALIBRATIONS: dict[str, tuple[CpuCalibration, BatchModel]] = {}
CALIBRATIONS_KEPT = 64


def _calibrate(fingerprint: Callable[[], str], workload: Workload | str, workload_args: dict[str, Any] | None,
               req: EstimateRequest, bm: BatchModel, notes: list[str]) -> tuple[CpuCalibration | None, BatchModel]:
    """Short real runs on this CPU (see calibrate.py); a workload object cannot run in a fresh process."""
    if not isinstance(workload, str):
        notes.append("not calibrated: a workload passed as an object cannot be run in a fresh process")
        return None, bm
    import json

    from advisor.errors import TrialError
    from advisor.estimate.calibrate import calibrate_cpu

    key = json.dumps([workload, workload_args or {}, fingerprint(), req.model_dump(mode="json")],
                     sort_keys=True, default=str)
    reused = key in _CALIBRATIONS
    if not reused:
        try:
            _CALIBRATIONS[key] = calibrate_cpu(workload, workload_args or {}, req, bm)
        except TrialError as exc:  # the real step fails here (e.g. no kernel for this dtype): the trace stands alone
            notes.append(f"not calibrated: {exc}")
            return None, bm
        while len(_CALIBRATIONS) > CALIBRATIONS_KEPT:
            del _CALIBRATIONS[next(iter(_CALIBRATIONS))]
    calib, bm = _CALIBRATIONS[key]
    notes.append(f"calibrated on this CPU with real steps at batch sizes {', '.join(map(str, calib.batches))}"
                 f"{' (runs of an earlier estimate in this process)' if reused else ''}: "
                 f"{calib.formula()} (runs within {calib.spread / 2**20:.0f} MiB of it; the largest batch keeps that clear)")
    if calib.used_real_traces:
        notes.append("real kernels allocate differently from the fake trace here (e.g. a workspace): "
                     "using traces of real steps at small batch sizes, extrapolated per allocation")
    return calib, bm


def _decoder_params(wl: Workload) -> int:
    from advisor.estimate.analytic import decoder_param_count

    return decoder_param_count(wl.decoder)


def _measured_points(fingerprint: Callable[[], str], hw: HardwareSpec, req: EstimateRequest, compile_mode: str,
                     predicts: str, measured: bool | MeasuredPeaks) -> list[tuple[int, int]]:
    """The store I/O at the estimator's edge: (batch size, peak bytes) of this configuration's measured
    peaks. A CPU's measured resident sets describe only the host they ran on, so a CPU target uses
    them only when it is this machine; a GPU's carry over to devices of the same catalog model."""
    from advisor.peaks import default_peaks, device_key, point_key, request_knobs

    if hw.device_type == "cpu" and not hw.is_local:
        return []
    store = default_peaks() if measured is True else measured
    if not store.may_hold_points():
        return []
    key = point_key(fingerprint(), device_key(hw), request_knobs(req, hw.world_size, compile_mode, predicts))
    return [(p.batch_size, p.peak_bytes) for p in store.points(key)]


def _measured_refinement(ev: _Evaluator, points: list[tuple[int, int]], notes: list[str]) -> _Evaluator:
    """Measured peaks refine the evaluator (refine.py says how, per device type)."""
    if ev.hw.device_type == "cpu":
        from advisor.estimate.calibrate import with_measured_peaks

        calib = with_measured_peaks(ev.req, ev.bm, ev.calib, tuple(points))
        notes.append(resident_note(points, calib, calibrated=ev.calib is not None))
        return _Evaluator(ev.hw, ev.req, ev.bm, calib)
    ev.refined = refine(points, ev.predicted_total)
    notes.append(ev.refined.note())
    return ev


def _largest_batches(ev: _Evaluator, calibrated: bool, points: list[tuple[int, int]], workload: Workload | str,
                     workload_args: dict[str, Any] | None, usable: int, notes: list[str]) -> dict[str, int]:
    """The largest batch per strategy. The request's own, on this CPU: re-solved after real runs near
    it when calibrated; with measured peaks and no calibration runs, also solved with the fit's slope
    a few posterior SDs steeper (refine.cautious), the smaller answer kept."""
    by_strategy = {s.value: ev.max_batch(usable, s) for s in _strategies(ev.hw)}
    own = ev.req.strategy.value
    if calibrated and ev.refined is None:
        again = _max_batch_near(ev, workload, workload_args, by_strategy[own], usable, notes)
        by_strategy[own] = by_strategy[own] if again is None else again
    elif points and ev.hw.device_type == "cpu" and ev.calib is not None:
        steep = cautious(ev.calib, [ev.transient(b) for b, _ in points], [p for _, p in points])
        answer = _Evaluator(ev.hw, ev.req, ev.bm, steep).max_batch(usable)
        if answer < by_strategy[own]:
            notes.append(f"largest batch {by_strategy[own]} -> {answer}: solved again with the resident-set slope "
                         f"{CAUTION:.0f} posterior SDs steeper ({steep.slope:.2f}), as the measured points alone say little "
                         "about it far from them")
            by_strategy[own] = answer
    return by_strategy


def _max_batch_near(ev: _Evaluator, workload: Workload | str, workload_args: dict[str, Any] | None, first: int,
                    usable: int, notes: list[str]) -> int | None:
    """The largest batch re-solved after real runs at the first answer and half of it (CPU,
    calibrated), when those runs are cheap; again from the new answer while it lands more than
    NEAR away from where the runs were (the fit then extrapolated), at most NEAR_ROUNDS times. None
    when no second round ran (see calibrate.py)."""
    import os

    from advisor.errors import TrialError
    from advisor.estimate.calibrate import Calibration, recalibrate_near

    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    answer, again = first, None
    for _ in range(NEAR_ROUNDS):
        if not isinstance(ev.calib, Calibration) or not isinstance(workload, str) or answer < 2:
            break
        if ev.predicted_total(answer) > RECALIBRATE_HOST_SHARE * host:
            break
        if answer > NEAR_REACH * max(ev.calib.batches):
            notes.append(f"largest batch {answer} not checked with real runs: over {NEAR_REACH}x the largest batch run "
                         f"({max(ev.calib.batches)}), too far to trust what a run there would cost")
            break
        try:
            calib = recalibrate_near(workload, workload_args or {}, ev.req, ev.bm, ev.calib, answer)
        except TrialError as exc:  # a run there failed (out of memory, say): the answer so far stands
            notes.append(f"largest batch {answer} not re-solved: a real run near it failed: {exc}")
            break
        if calib is None:
            break
        ev = _Evaluator(ev.hw, ev.req, ev.bm, calib)
        ran_at, answer = answer, ev.max_batch(usable)
        again = answer
        notes.append(f"largest batch re-solved after real runs at {ran_at} (fit over batch sizes "
                     f"{', '.join(map(str, calib.batches))}: {calib.formula()}, runs within {calib.spread / 2**20:.0f} MiB of it): {ran_at} -> {answer}")
        if abs(answer - ran_at) <= NEAR * ran_at:
            break
    return again

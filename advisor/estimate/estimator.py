"""estimate_memory: workload + hardware + configuration -> MemoryEstimate (per device)."""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable

from advisor.config import OptimizerKind, Precision, Strategy
from advisor.errors import EstimateError, SpecError
from advisor.estimate.batchmodel import BatchModel
from advisor.estimate.cuda_reduce import ReduceGpu
from advisor.estimate.model import Breakdown, EstimateRequest, MemoryEstimate
from advisor.estimate.evaluator import Evaluator
from advisor.estimate.largest import largest_batches
from advisor.estimate.overhead import CpuCalibration
from advisor.estimate.refine import refine, resident_note
from advisor.estimate.roofline import step_time
from advisor.estimate.stages import report
from advisor.estimate.trace import Trace, trace_training
from advisor.fingerprint import workload_fingerprint
from advisor.hardware.spec import HardwareSpec
from advisor.workload import Workload

if TYPE_CHECKING:
    from advisor.estimate.calibrate import Run
    from advisor.peaks import MeasuredPeaks

log = logging.getLogger(__name__)


def _resolve(workload: Workload | str, hardware: HardwareSpec | str, workload_args: dict[str, Any] | None):
    from advisor.hardware import get_hardware
    from advisor.workload import load_workload

    wl = load_workload(workload, workload_args) if isinstance(workload, str) else workload
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    return wl, hw


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


def _tracer(wl: Workload, req: EstimateRequest, cpu: bool, device_type: str = "cpu",
            cuda: bool = False, reduce_gpu: ReduceGpu | None = None) -> Callable[..., Trace]:
    """trace(b, flops=True): the request's training step traced at batch b."""
    kw = dict(precision=req.precision, optimizer=req.optimizer, checkpointing=req.checkpointing,
              fused_backward=req.fused_backward, optimizer_impl=_trace_impl(req, device_type), cpu_workspaces=cpu,
              cuda_workspaces=cuda, device=device_type, reduce_gpu=reduce_gpu)

    def retrace(b: int, flops: bool = True) -> Trace:
        return trace_training(wl, b, count_flops=flops, **kw)

    return retrace


def _batch_model(wl: Workload, req: EstimateRequest, cpu: bool, device_type: str = "cpu", cuda: bool = False,
                 reduce_gpu: ReduceGpu | None = None) -> BatchModel:
    retrace = _tracer(wl, req, cpu, device_type, cuda, reduce_gpu)

    a = req.batch_size
    if a == 1:
        # Batch 1 often takes other kernels' paths (e.g. matmuls folded differently) than larger
        # batches, so it is traced exactly and the batch scaling comes from traces at 2 and 4.
        return BatchModel(a=2, trace_a=retrace(2), c=4, trace_c=retrace(4, False), exact={1: retrace(1)},
                          tracer=lambda b: retrace(b, False))
    c = a * 2 if a < 4 else a // 2
    return BatchModel(a=a, trace_a=retrace(a), c=c, trace_c=retrace(c, False), tracer=lambda b: retrace(b, False))


def estimate_memory(workload: Workload | str, hardware: HardwareSpec | str, batch_size: int | None = None, *,
                    precision: Precision | str = Precision.fp32, optimizer: OptimizerKind | str = OptimizerKind.adamw,
                    strategy: Strategy | str = Strategy.single, checkpointing: bool = False, fused_backward: bool = False,
                    offload_optimizer: bool = False, offload_params: bool = False, optimizer_impl: str | None = None,
                    workload_args: dict[str, Any] | None = None, calibrate: bool | None = None,
                    margin: float | None = None, method: str = "auto", measured: bool | MeasuredPeaks = True,
                    compile_mode: str = "none", exact_largest: bool = True) -> MemoryEstimate:
    """Predict per-device peak memory of a training step, whether it fits, and the largest batch.

    `method`: 'traced' (fake-tensor trace), 'analytic' (decoder formulas), or 'auto' (analytic
    for decoders above settings.trace_param_limit parameters, else traced). `calibrate`: allow
    a short real run at small batches when the target is this machine's CPU, and running each cuDNN
    convolution and LSTM layer shape and each reduction once on this machine's GPU when that is the
    target (default: settings).
    `measured`: refine with measured peaks of the same workload fingerprint, device and knobs
    (`compile_mode` among them) from the default store (True), the given store, or not (False).
    `exact_largest`: where kernels' scratch is not affine in the batch, search the largest batch again on exact
    traces (up to largest.EXACT_TRACES more); False for callers that need only the request's own batch (the tuner's pruning, a
    trial's prediction): the largest batch is then the traces' line's, and a note says so.
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

    do_cal = get_settings().calibrate if calibrate is None else calibrate
    local_cpu, probe_gpu = hw.device_type == "cpu" and hw.is_local, do_cal and _local_cuda(hw)
    reduce_gpu = None  # reductions' scratch worked out, where no GPU measures it
    if hw.device_type == "cuda" and not probe_gpu:
        reduce_gpu = ReduceGpu.on_device() if _local_cuda(hw) else ReduceGpu.of(hw.accelerator)
    report(f"tracing {wl.name} at batch {batch}")
    bm, used = _choose_batch_model(wl, workload, workload_args, req, method, notes, cpu=local_cpu,
                                   device_type=hw.device_type, cuda=probe_gpu, reduce_gpu=reduce_gpu)
    if bm.trace_a.sized_kernels:
        where = ("CUDA op shape(s) (cuDNN's convolutions and LSTM layers, reductions) once on zeros on this machine's "
                 "GPU" if bm.trace_a.sized_on == "cuda" else "op shape(s) (oneDNN's convolutions and LSTM layers, sparse "
                 "kernels) once on zeros on this CPU")
        notes.append(f"kernel scratch and workspaces sized by running {bm.trace_a.sized_kernels} {where} "
                     "(fake ops report none)")
    if bm.trace_a.reduce_scratch:
        notes.append(f"the cross-block scratch of {bm.trace_a.reduce_scratch} reduction shape(s) (a linear layer's bias "
                     f"gradient, a sum over the batch) worked out from torch's launch rules for the "
                     f"{hw.accelerator.name}'s {reduce_gpu.multiprocessors} multiprocessors, at each batch size "
                     "(fake ops report none)")
    if bm.trace_a.unsized_cudnn:
        notes.append(f"cuDNN's workspaces for {bm.trace_a.unsized_cudnn} convolution or LSTM op shape(s) are not "
                     "counted: their size follows the algorithm cuDNN picks on the device itself, so only an "
                     "estimate on that GPU (--hardware local, calibrating) sizes them (on an H200 the presets' "
                     "convolution nets and LSTM reserved up to 1.9 times the estimate without them)")
    if bm.trace_a.init_skipped:
        notes.append(f"{wl.name}'s build reads its tensors' values, which fake tensors do not have (e.g. torch's "
                     "nn.init.trunc_normal_, a rejection loop): traced with torch.nn.init's initializers skipped, as "
                     "initial values change no memory")
    if bm.trace_a.ctc_bounded:
        notes.append("ctc_loss's target lengths are a tensor, whose values fake tensors do not have: its alpha and "
                     "beta tables are sized for the longest target the targets' shape allows (exact where one is "
                     "that long; more otherwise)")
    if bm.trace_a.probed_copies:
        where = "this machine's GPU" if bm.trace_a.sized_on == "cuda" else "this CPU"
        notes.append(f"{bm.trace_a.probed_copies} op shape(s) with strided inputs run once on zeros on {where}, for the "
                     "contiguous copies their kernels make inside themselves (dispatch shows none)")
    if bm.trace_a.probed_reductions:
        notes.append(f"{bm.trace_a.probed_reductions} reduction shape(s) run once on zeros on this CPU hold scratch "
                     "inside their kernels (a mean over a 16-bit input sums a float32 copy of it; dispatch shows none)")
    if bm.trace_a.probed_products:
        notes.append(f"{bm.trace_a.probed_products} 16-bit matrix product shape(s) run once on zeros on this CPU hold "
                     "scratch inside their kernels beside their output (oneDNN's buffer; dispatch shows none)")
    # the calibration cache and the measured peaks both key on it; it builds the model on meta: once
    fingerprint = functools.cache(functools.partial(workload_fingerprint, wl))
    calib = None
    record = _run_recorder(fingerprint, hw, req, measured) if local_cpu else None
    if local_cpu and do_cal and used != "analytic":
        from advisor.estimate.calibrate import runs_at_batch

        at_batch = runs_at_batch(batch, Evaluator(hw, req, bm, None).predicted_total(batch))
        calib, bm = _calibrate(fingerprint, workload, workload_args, req, bm, notes, record, at_batch)

    ev = Evaluator(hw, req, bm, calib)
    predicts = "cpu_rss" if hw.device_type == "cpu" else "cuda_reserved"
    points = _measured_points(fingerprint, hw, req, compile_mode, predicts, measured) if measured else []
    if calib is not None:  # its own runs, kept as measured peaks too, count once
        points = _less_own_runs(points, getattr(calib, "rss", ()))
    if points and hw.device_type == "cpu":
        points = _from_an_eighth_of_the_batch(ev, _same_side_of_mmap_threshold(ev, points, notes), notes)
    if points:
        ev = _measured_refinement(ev, points, notes)
    tr, allocated, parts, ov = ev.at(batch, runs=True)
    total, _ = ev.total(batch, runs=True)
    _note_runs_at_batch(ev, batch, notes)
    parts["overhead"] = total - sum(parts.values())
    if parts["overhead"] < 0:
        parts["temporaries"] += parts["overhead"]
        parts["overhead"] = 0
    fits = total + ov.runtime <= usable
    # workspaces sized on the GPU, and the scratch of 16-bit products on this CPU, are not affine in the batch: the
    # largest batch is checked on exact traces (a calibration's real runs near the answer take the CPU's in instead)
    exact = None
    if bm.trace_a.sized_on == "cuda" and bm.trace_a.sized_kernels:
        exact = "cuDNN's workspaces sized at each (they follow the algorithm cuDNN picks for the shape, not a line in " \
                "the batch)"
    elif local_cpu and calib is None and bm.trace_a.probed_products:
        exact = "16-bit matrix products' scratch probed at each (oneDNN's buffer follows the blocking it picks for " \
                "the shape, not a line in the batch)"
    if exact and not exact_largest:
        notes.append(f"largest batch from the traces' line, not searched again on exact traces ({exact}): not asked for")
        exact = None
    trace_at = _tracer(wl, req, local_cpu, hw.device_type, probe_gpu) if exact else None
    by_strategy = largest_batches(ev, calib is not None, points, workload, workload_args, usable, notes, record,
                                  trace_at, exact or "")
    if not fits and by_strategy[req.strategy.value] >= batch:  # real runs at the batch outweigh the line there
        notes.append(f"largest batch {by_strategy[req.strategy.value]} -> {batch - 1}: the real runs at batch {batch} "
                     "say it does not fit")
        by_strategy[req.strategy.value] = batch - 1
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


def _note_runs_at_batch(ev: Evaluator, batch: int, notes: list[str]) -> None:
    """Say where real runs at the batch itself, or the runs' heap replayed there, moved the resident set off
    the fit's line (CPU)."""
    from advisor.estimate import heaplog
    from advisor.estimate.calibrate import Calibration

    if not isinstance(ev.calib, Calibration):
        return
    runs, replays = ev.calib.runs_at(batch), [r for b, r in ev.calib.replayed if b == batch]
    if not runs and not replays:
        return
    line, at = ev.total(batch)[0], ev.total(batch, runs=True)[0]
    n = len(runs) + len(replays)

    def mib(xs: list[int]) -> str:
        return ", ".join(f"{x / 2**20:.0f}" for x in xs)

    what = [f"{len(runs)} real run(s) at the batch itself ({mib(runs)} MiB)"] if runs else []
    what += [f"the calibration runs' own allocations (every malloc and free, logged), their tensors resized to batch "
             f"{batch} as the trace resizes them and replayed through this machine's glibc, {heaplog.DRAWS} times each "
             f"with a few KiB held first ({mib(replays)} MiB, the draws' median, weighed as one run)"] if replays else []
    notes.append(f"resident set at batch {batch}: {at / 2**20:.0f} MiB, the fit's {line / 2**20:.0f} MiB drawn "
                 f"{n}/{n + 1} of the way to the mean of {' and '.join(what)}")


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
                        device_type: str = "cpu", cuda: bool = False,
                        reduce_gpu: ReduceGpu | None = None) -> tuple[BatchModel, str]:
    """Formulas, a fake-tensor trace, or (untraceable model) real-tensor traces at batch 1 and 2."""
    from advisor.settings import get_settings

    limit = get_settings().trace_param_limit
    if method == "analytic" or (method == "auto" and wl.decoder is not None and _decoder_params(wl) > limit):
        from advisor.estimate.analytic import analytic_trace

        notes.append("analytic: per-layer decoder formulas (Korthikanti et al. 2022); model too large to trace quickly")
        return BatchModel(a=req.batch_size, trace_a=analytic_trace(wl, req.batch_size, req),
                          retrace=lambda b: analytic_trace(wl, b, req)), "analytic"
    try:
        return _batch_model(wl, req, cpu, device_type, cuda, reduce_gpu), "traced"
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
               req: EstimateRequest, bm: BatchModel, notes: list[str],
               record: Callable[[tuple[Run, ...]], None] | None = None,
               at_batch: int = 0) -> tuple[CpuCalibration | None, BatchModel]:
    """Short real runs on this CPU (see calibrate.py), or those of an earlier estimate of the same request
    (in this process, or kept on this host: calcache.py); a workload object cannot run in a fresh
    process. New runs go to `record` (the measured-peak store) too. `at_batch`: runs at the batch itself
    besides (calibrate.runs_at_batch)."""
    if not isinstance(workload, str):
        notes.append("not calibrated: a workload passed as an object cannot be run in a fresh process")
        return None, bm
    import json

    from advisor.errors import TrialError
    from advisor.estimate import calcache
    from advisor.estimate.calibrate import calibrate_cpu, calibration_batches, mapped_regime_note, top_runs

    request = req.model_dump(mode="json")
    key = json.dumps([workload, workload_args or {}, fingerprint(), request, at_batch], sort_keys=True, default=str)
    reused = " (runs of an earlier estimate in this process)" if key in _CALIBRATIONS else ""
    if not reused:
        disk_key = calcache.calibration_key(workload, workload_args or {}, fingerprint(), {**request, "at_batch": at_batch})
        kept = calcache.load(disk_key, bm)
        if kept is not None:
            reused = " (runs of an earlier estimate on this host, kept in the data dir)"
            _CALIBRATIONS[key] = kept
        else:
            sizes = calibration_batches(req.batch_size)
            at = f" and {req.batch_size} (x{at_batch})" if at_batch else f" ({sizes[-1]} x{top_runs(at_batch)})"
            report(f"calibrating: real steps in fresh processes at batch sizes {', '.join(map(str, sizes))}{at}")
            try:
                _CALIBRATIONS[key] = calibrate_cpu(workload, workload_args or {}, req, bm, at_batch=at_batch)
            except TrialError as exc:  # the real step fails here (e.g. no kernel for this dtype): the trace stands alone
                notes.append(f"not calibrated: {exc}")
                return None, bm
            _keep(disk_key, *_CALIBRATIONS[key])
            if record is not None:
                record(_CALIBRATIONS[key][0].rss)
        while len(_CALIBRATIONS) > CALIBRATIONS_KEPT:
            del _CALIBRATIONS[next(iter(_CALIBRATIONS))]
    if reused:
        report(f"calibration reused{reused}")
    given = bm
    calib, bm = _CALIBRATIONS[key]
    counts = Counter(b for b, _, _ in calib.rss)
    sizes = ", ".join(f"{b} x{counts[b]}" if counts[b] > 1 else str(b) for b in calib.batches)
    notes.append(f"calibrated on this CPU with real steps at batch sizes {sizes}{reused}: "
                 f"{calib.formula()} (runs within {calib.spread / 2**20:.0f} MiB of it; the largest batch keeps that, and "
                 f"at least {calib.noise_share():.0%} of its resident set, a smaller share past 1 GB, clear)")
    if not calib.replayed and not at_batch:
        from advisor.estimate import heaplog

        if heaplog.tools() is None:
            notes.append("the runs' heap was not replayed at the batch: its logger needs Linux with glibc and a C "
                         "compiler (CC, cc or gcc) to build")
    fixed = sorted({(b, t) for b, _, t in calib.rss if t is not None})
    if fixed:
        notes.append(f"the runs at batch sizes {', '.join(str(b) for b, _ in fixed)} fixed glibc's mmap threshold at "
                     f"{', '.join(f'{t / 2**20:g}' for _, t in fixed)} MiB, their share of its 32 MiB maximum: what glibc "
                     "maps on its own at the batch asked about (and unmaps when freed), they map too")
    regime = mapped_regime_note(req, bm, calib.rss, req.batch_size)
    if regime:
        notes.append(regime)
    if calib.used_real_traces:
        notes.append(real_traces_note(given, bm, req.batch_size))
    return calib, bm


def real_traces_note(given: BatchModel, used: BatchModel, batch: int) -> str:
    """What the estimate says where the calibration's real traces (at `used.a` and `used.c`) replaced
    `given`'s: the fake trace's, or the real-step fallback's at batch 1 and 2; and how they reach `batch`.
    Traces whose allocations differ (a graph that follows the data) reach it phase by phase, as each
    category grew between them, and a count the data sets need not keep growing that way: a universal
    transformer's ponder steps (bench/workloads/fresh6.py:act) ran 12 at batch 16 and 10 at 32, and its
    live peak at 32 came out 18% over (session 50)."""
    if given.tracer is None and given.retrace is None:
        # not "nearer the batch": at batch 1 or 2 the calibration traces 1 and 2 again
        note = f"traced again on real steps at batch sizes {used.a} and {used.c} for the calibration"
    else:
        note = ("real kernels allocate differently from the fake trace here (e.g. a workspace): using traces of "
                f"real steps at batch sizes {used.a} and {used.c}")
    if used.aligned is None and batch not in (used.a, used.c):
        return note + (f"; their allocations differ (the graph follows the data), so the peak at {batch} is "
                       f"extrapolated phase by phase as each kind of memory grew from {used.a} to {used.c}: where "
                       "a count the data sets (tokens kept, loop steps) grows otherwise, it is off by as much")
    return note + ", extrapolated per allocation"


def _keep(disk_key: str, calib: CpuCalibration, bm: BatchModel) -> None:
    """Keep a new calibration for later processes; one that cannot be written costs them the reuse only."""
    from advisor.estimate import calcache

    try:
        calcache.save(disk_key, calib, bm)
    except OSError as exc:
        log.warning("calibration not kept for later estimates: %s", exc)


def _run_recorder(fingerprint: Callable[[], str], hw: HardwareSpec, req: EstimateRequest,
                  measured: bool | MeasuredPeaks) -> Callable[[tuple[Run, ...]], None] | None:
    """Where a calibration's runs go as measured peaks: each is DESIGN.md's CPU protocol in a fresh
    process, so an estimate without runs of its own (the tuner's pruning, a trial's prediction) is
    refined by them later. Only where the runs ran the request as asked (one process, the CPU's
    default optimizer implementation, nothing offloaded) and measured peaks are in use at all. A run
    that fixed glibc's mmap threshold is kept with it: later fits split its allocations at it."""
    if measured is False or hw.world_size != 1 or req.strategy != Strategy.single or req.optimizer_impl is not None \
            or req.offload_optimizer or req.offload_params:
        return None
    from advisor.errors import AdvisorError
    from advisor.peaks import default_peaks, record_points

    def record(runs: tuple[Run, ...]) -> None:
        try:
            record_points(fingerprint(), hw, req, "none", "cpu_rss", [(b, peak, None, t) for b, peak, t in runs],
                          default_peaks() if measured is True else measured)
        except AdvisorError as exc:  # a run that cannot be kept costs later estimates a refinement, nothing more
            log.warning("calibration runs not kept as measured peaks: %s", exc)

    return record


def _decoder_params(wl: Workload) -> int:
    from advisor.estimate.analytic import decoder_param_count

    return decoder_param_count(wl.decoder)


def _measured_points(fingerprint: Callable[[], str], hw: HardwareSpec, req: EstimateRequest, compile_mode: str,
                     predicts: str, measured: bool | MeasuredPeaks) -> list[Run]:
    """The store I/O at the estimator's edge: (batch size, peak bytes, the glibc mmap threshold the run
    fixed or None) of this configuration's measured peaks. A CPU's measured resident sets describe
    only the host they ran on, so a CPU target uses them only when it is this machine; a GPU's carry
    over to devices of the same catalog model."""
    from advisor.peaks import default_peaks, request_key

    if hw.device_type == "cpu" and not hw.is_local:
        return []
    store = default_peaks() if measured is True else measured
    if not store.may_hold_points():
        return []
    key = request_key(fingerprint(), hw, req, compile_mode, predicts)
    return [(p.batch_size, p.peak_bytes, p.mmap_threshold) for p in store.points(key)]


def _less_own_runs(points: list[Run], own: tuple[Run, ...]) -> list[Run]:
    """The measured peaks less a calibration's own runs (recorded among them too), each run once: two runs
    can measure the same bytes (tiny-mlp's runs at batch 12 land on 4 KiB pages within ~0.6 MiB of each
    other), so an earlier run equal to one of the calibration's stays. Taken off by value, it went too: the
    likeliest reading of session 45's CI, where tiny-mlp at 96 after an estimate at 24 fitted one of the
    earlier two runs at 12, not both."""
    left = Counter(own)
    kept = []
    for p in points:
        if left[p]:
            left[p] -= 1
        else:
            kept.append(p)
    return kept


def _same_side_of_mmap_threshold(ev: Evaluator, points: list[Run], notes: list[str]) -> list[Run]:
    """A CPU's measured peaks without those that lie across glibc's mmap threshold from the batch asked
    about (calibrate.across_threshold), where other runs remain to fit: what the batch maps (and frees
    from the resident set) they served from the heap (which keeps it), and the resident bytes per
    transient byte do not carry over; calibration runs scale the threshold for the same reason. mlp
    fp32 adamw b4096 after a first estimate at 1024 (session 15's VM): 455 MiB with that estimate's runs
    at 128-512 left out (slope 1.07); the code before, from a calibration of its own with 6 peaks
    joined, these among them, 482 MiB (1.39); measured 429-457 MiB (two medians of 3)."""
    from advisor.estimate.calibrate import across_threshold, mapped_regime_note

    across = set(across_threshold(ev.req, ev.bm, tuple(points), ev.req.batch_size))
    if not across:
        return points
    if len(across) == len(points) and ev.calib is None:  # nothing else to fit: they stand, with a warning
        regime = mapped_regime_note(ev.req, ev.bm, tuple(points), ev.req.batch_size)
        notes.extend([regime] if regime else [])
        return points
    notes.append(f"{len(across)} measured peak(s) at batch size(s) {', '.join(map(str, sorted({b for b, *_ in across})))} "
                 f"left out of the fit: they ran across glibc's mmap threshold from batch {ev.req.batch_size} (its "
                 "tensors of 32 MiB and up are mapped and leave the resident set when freed; theirs were served "
                 "from the heap, which keeps them)")
    return [p for p in points if p not in across]


def _from_an_eighth_of_the_batch(ev: Evaluator, points: list[Run], notes: list[str]) -> list[Run]:
    """A CPU's measured peaks from an eighth of the batch asked about up where a calibration's runs
    (from an eighth up) remain to fit; without one every peak stays, their span being what draws the
    slope from the default's prior (`with_measured_peaks`). The resident bytes per transient byte
    change with the batch (which freed heap chunks later allocations fit depends on their sizes:
    session 19's mallinfo2 readings), so runs far below it describe another heap; `recalibrate_near`
    keeps the first round's runs from an eighth up for the same reason, and an estimate no longer
    depends on which smaller batches were estimated before it. Unseen audio net bf16 adamw b32
    (session 19): its calibration (4, 8, 16) with the b8 estimate's runs at 2, 3, 4 fitted 2.07 x
    transient, +16.1% against its target; from 4 up, +10.7%. On session 20's grid and unseen runs
    it moved 29 cases, 11 closer and 14 further, mean |error| +0.1 points (bench "ablation" row)."""
    from advisor.estimate.calibrate import from_an_eighth

    near = list(from_an_eighth(points, ev.req.batch_size))
    far = sorted({p[0] for p in points if p not in near})
    if not far or ev.calib is None:
        return points
    notes.append(f"measured peak(s) at batch size(s) {', '.join(map(str, far))} left out of the fit: under an eighth of "
                 f"batch {ev.req.batch_size}, where the heap reuses freed memory otherwise")
    return near


def _measured_refinement(ev: Evaluator, points: list[Run], notes: list[str]) -> Evaluator:
    """Measured peaks refine the evaluator (refine.py says how, per device type)."""
    if ev.hw.device_type == "cpu":
        from advisor.estimate.calibrate import with_measured_peaks

        calib = with_measured_peaks(ev.req, ev.bm, ev.calib, tuple(points))
        notes.append(resident_note(points, calib, calibrated=ev.calib is not None))
        return Evaluator(ev.hw, ev.req, ev.bm, calib)
    ev.refined = refine([(b, peak) for b, peak, _ in points], ev.predicted_total)
    notes.append(ev.refined.note())
    return ev

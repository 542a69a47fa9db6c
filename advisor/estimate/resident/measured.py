"""A CPU estimate's resident set fitted on real runs: this CPU's calibration runs and the measured peaks kept."""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Callable

from advisor.config import Strategy
from advisor.estimate.batchmodel import BatchModel
from advisor.estimate.evaluator import Evaluator
from advisor.estimate.model import Case, Fitted
from advisor.estimate.refine import resident_note
from advisor.estimate.stages import report

if TYPE_CHECKING:
    from advisor.estimate.resident.calibration import Run
    from advisor.estimate.resident.overhead import CpuCalibration

log = logging.getLogger(__name__)

Recorder = Callable[[tuple["Run", ...]], None]

# Calibrations done in this process, by workload and request: a second estimate of the same request
# (the API asked again, the tuner pruning, a before/after comparison) reuses the runs rather than
# repeating them and answering differently by their noise. Bounded: the oldest goes first.
_CALIBRATIONS: dict[str, tuple[CpuCalibration, BatchModel]] = {}
CALIBRATIONS_KEPT = 64


def resident_fit(case: Case, bm: BatchModel, calibrate: bool, stored: Callable[[], list[Run]],
                 notes: list[str]) -> Fitted:
    """The evaluator of a CPU target: calibrated by real runs on this CPU where `calibrate` and the target
    is this machine, then fitted with the measured peaks `stored()` of the same configuration that describe
    the batch asked about. Appends what it did to `notes`."""
    hw, req = case.hw, case.req
    record = _run_recorder(case) if hw.is_local else None
    calib = None
    if hw.is_local and calibrate:
        from advisor.estimate.resident.calibrate import runs_at_batch

        at_batch = runs_at_batch(req.batch_size, Evaluator(hw, req, bm, None).predicted_total(req.batch_size))
        calib, bm = _calibrate(case, bm, notes, record, at_batch)
    ev = Evaluator(hw, req, bm, calib)
    points = stored() if case.options.measured else []
    if calib is not None:  # its own runs, kept as measured peaks too, count once
        points = _less_own_runs(points, getattr(calib, "rss", ()))
    if points:
        points = _from_an_eighth_of_the_batch(ev, _same_side_of_mmap_threshold(ev, points, notes), notes)
    if points:
        from advisor.estimate.resident.fit import with_measured_peaks

        fitted = with_measured_peaks(req, ev.bm, ev.calib, tuple(points))
        notes.append(resident_note(points, fitted, calibrated=ev.calib is not None))
        ev = Evaluator(hw, req, ev.bm, fitted)
    _note_runs_at_batch(ev, req.batch_size, notes)
    return Fitted(ev, points, calibrated=calib is not None, record=record)


def _calibrate(case: Case, bm: BatchModel, notes: list[str], record: Recorder | None = None,
               at_batch: int = 0) -> tuple[CpuCalibration | None, BatchModel]:
    """Short real runs on this CPU (resident/calibrate.py), or those of an earlier estimate of the same
    request (in this process, or kept on this host: calcache.py); a workload object cannot run in a fresh
    process. New runs go to `record` (the measured-peak store) too. `at_batch`: runs at the batch itself
    besides (calibrate.runs_at_batch)."""
    if not isinstance(case.workload, str):
        notes.append("not calibrated: a workload passed as an object cannot be run in a fresh process")
        return None, bm
    key = _calibration_key(case, at_batch)
    reused = " (runs of an earlier estimate in this process)" if key in _CALIBRATIONS else ""
    if not reused:
        reused = _load_or_run(case, bm, key, record, at_batch, notes)
        if reused is None:
            return None, bm
        while len(_CALIBRATIONS) > CALIBRATIONS_KEPT:
            del _CALIBRATIONS[next(iter(_CALIBRATIONS))]
    if reused:
        report(f"calibration reused{reused}")
    calib, used = _CALIBRATIONS[key]
    notes.extend(_calibration_notes(case, bm, used, calib, reused, at_batch))
    return calib, used


def _calibration_key(case: Case, at_batch: int) -> str:
    import json

    request = case.req.model_dump(mode="json")
    return json.dumps([case.workload, case.workload_args or {}, case.fingerprint(), request, at_batch],
                      sort_keys=True, default=str)


def _load_or_run(case: Case, bm: BatchModel, key: str, record: Recorder | None, at_batch: int,
                 notes: list[str]) -> str | None:
    """Put the calibration under `key`: kept on this host, or run now. Returns what to say of its reuse
    ("" for new runs), or None where the real step fails (the trace then stands alone, said in `notes`)."""
    from advisor.errors import TrialError
    from advisor.estimate.resident import calcache
    from advisor.estimate.resident.calibrate import calibrate_cpu, calibration_batches, top_runs

    req, args = case.req, case.workload_args or {}
    disk_key = calcache.calibration_key(case.workload, args, case.fingerprint(),
                                        {**req.model_dump(mode="json"), "at_batch": at_batch})
    kept = calcache.load(disk_key, bm)
    if kept is not None:
        _CALIBRATIONS[key] = kept
        return " (runs of an earlier estimate on this host, kept in the data dir)"
    if case.options.calibrate == "kept":
        notes.append("not calibrated: no calibration of this request is kept on this host, and none is run for this "
                     "caller (`advisor estimate` here makes and keeps one)")
        return None
    sizes = calibration_batches(req.batch_size)
    at = f" and {req.batch_size} (x{at_batch})" if at_batch else f" ({sizes[-1]} x{top_runs(at_batch)})"
    report(f"calibrating: real steps in fresh processes at batch sizes {', '.join(map(str, sizes))}{at}")
    try:
        _CALIBRATIONS[key] = calibrate_cpu(case.workload, args, req, bm, at_batch=at_batch)
    except TrialError as exc:  # the real step fails here (e.g. no kernel for this dtype)
        notes.append(f"not calibrated: {exc}")
        return None
    _keep(disk_key, *_CALIBRATIONS[key])
    if record is not None:
        record(_CALIBRATIONS[key][0].rss)
    return ""


def _calibration_notes(case: Case, given: BatchModel, used: BatchModel, calib: CpuCalibration, reused: str,
                       at_batch: int) -> list[str]:
    """What a calibration says of itself: its runs and line, and where its runs or traces stand apart."""
    from advisor.estimate.resident.threshold import mapped_regime_note

    req = case.req
    counts = Counter(b for b, _, _ in calib.rss)
    sizes = ", ".join(f"{b} x{counts[b]}" if counts[b] > 1 else str(b) for b in calib.batches)
    notes = [f"calibrated on this CPU with real steps at batch sizes {sizes}{reused}: {calib.formula()} (runs "
             f"within {calib.spread / 2**20:.0f} MiB of it; the largest batch keeps that, and at least "
             f"{calib.noise_share():.0%} of its resident set, a smaller share past 1 GB, clear)"]
    if not calib.replayed and not at_batch:
        from advisor.estimate.resident import heaplog

        if heaplog.tools() is None:
            notes.append("the runs' heap was not replayed at the batch: its logger needs Linux with glibc and a C "
                         "compiler (CC, cc or gcc) to build")
    fixed = sorted({(b, t) for b, _, t in calib.rss if t is not None})
    if fixed:
        notes.append(f"the runs at batch sizes {', '.join(str(b) for b, _ in fixed)} fixed glibc's mmap threshold at "
                     f"{', '.join(f'{t / 2**20:g}' for _, t in fixed)} MiB, their share of its 32 MiB maximum: what "
                     "glibc maps on its own at the batch asked about (and unmaps when freed), they map too")
    regime = mapped_regime_note(req, used, calib.rss, req.batch_size)
    if regime:
        notes.append(regime)
    if calib.used_real_traces:
        notes.append(real_traces_note(given, used, req.batch_size))
    return notes


def real_traces_note(given: BatchModel, used: BatchModel, batch: int) -> str:
    """What the estimate says where the calibration's real traces (at `used.a` and `used.c`) replaced
    `given`'s: the fake trace's, or the real-step fallback's at batch 1 and 2; and how they reach `batch`.
    Traces whose allocations differ (a graph that follows the data) reach it phase by phase, as each
    category grew between them; a count the data sets (a universal transformer's ponder steps,
    bench/workloads/fresh6.py:act) need not keep growing that way."""
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
    from advisor.estimate.resident import calcache

    try:
        calcache.save(disk_key, calib, bm)
    except OSError as exc:
        log.warning("calibration not kept for later estimates: %s", exc)


def _run_recorder(case: Case) -> Recorder | None:
    """Where a calibration's runs go as measured peaks: each is docs/design.md's CPU protocol in a fresh
    process, so an estimate without runs of its own (the tuner's pruning, a trial's prediction) is
    refined by them later. Only where the runs ran the request as asked (one process, the CPU's
    default optimizer implementation, nothing offloaded) and measured peaks are in use at all. A run
    that fixed glibc's mmap threshold is kept with it: later fits split its allocations at it."""
    hw, req, measured = case.hw, case.req, case.options.measured
    if measured is False or hw.world_size != 1 or req.strategy != Strategy.single or req.optimizer_impl is not None \
            or req.offload_optimizer or req.offload_params:
        return None
    from advisor.errors import AdvisorError
    from advisor.peaks import default_peaks, record_points

    def record(runs: tuple[Run, ...]) -> None:
        try:
            record_points(case.fingerprint(), hw, req, "none", "cpu_rss", [(b, peak, None, t) for b, peak, t in runs],
                          default_peaks() if measured is True else measured)
        except AdvisorError as exc:  # a run that cannot be kept costs later estimates a refinement, nothing more
            log.warning("calibration runs not kept as measured peaks: %s", exc)

    return record


def _less_own_runs(points: list[Run], own: tuple[Run, ...]) -> list[Run]:
    """The measured peaks less a calibration's own runs (recorded among them too), each run once: two runs
    can measure the same bytes (tiny-mlp's runs at batch 12 land on 4 KiB pages within ~0.6 MiB of each
    other), so an earlier run equal to one of the calibration's stays."""
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
    about (threshold.across_threshold), where other runs remain to fit: what the batch maps (and frees
    from the resident set) they served from the heap (which keeps it), so their resident bytes per
    transient byte do not carry over; calibration runs scale the threshold for the same reason."""
    from advisor.estimate.resident.threshold import across_threshold, mapped_regime_note

    across = set(across_threshold(ev.req, ev.bm, tuple(points), ev.req.batch_size))
    if not across:
        return points
    if len(across) == len(points) and ev.calib is None:  # nothing else to fit: they stand, with a warning
        regime = mapped_regime_note(ev.req, ev.bm, tuple(points), ev.req.batch_size)
        notes.extend([regime] if regime else [])
        return points
    batches = ", ".join(map(str, sorted({b for b, *_ in across})))
    notes.append(f"{len(across)} measured peak(s) at batch size(s) {batches} "
                 f"left out of the fit: they ran across glibc's mmap threshold from batch {ev.req.batch_size} (its "
                 "tensors of 32 MiB and up are mapped and leave the resident set when freed; theirs were served "
                 "from the heap, which keeps them)")
    return [p for p in points if p not in across]


def _from_an_eighth_of_the_batch(ev: Evaluator, points: list[Run], notes: list[str]) -> list[Run]:
    """A CPU's measured peaks from an eighth of the batch asked about up, where a calibration's runs
    (from an eighth up) remain to fit; without one every peak stays, their span being what draws the
    slope from the default's prior (fit.with_measured_peaks). The resident bytes per transient byte
    change with the batch (which freed heap chunks later allocations fit depends on their sizes), so
    runs far below it describe another heap; calibrate.recalibrate_near keeps the first round's runs
    from an eighth up for the same reason, and an estimate does not depend on which smaller batches
    were estimated before it."""
    from advisor.estimate.resident.fit import from_an_eighth

    near = list(from_an_eighth(points, ev.req.batch_size))
    far = sorted({p[0] for p in points if p not in near})
    if not far or ev.calib is None:
        return points
    notes.append(f"measured peak(s) at batch size(s) {', '.join(map(str, far))} left out of the fit: under an eighth "
                 f"of batch {ev.req.batch_size}, where the heap reuses freed memory otherwise")
    return near


def _note_runs_at_batch(ev: Evaluator, batch: int, notes: list[str]) -> None:
    """Say where real runs at the batch itself, or the runs' heap replayed there, moved the resident set off
    the fit's line."""
    from advisor.estimate.resident import heaplog
    from advisor.estimate.resident.calibration import Calibration

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
    if replays:
        what.append(f"the calibration runs' own allocations (every malloc and free, logged), their tensors resized to "
                    f"batch {batch} as the trace resizes them and replayed through this machine's glibc, "
                    f"{heaplog.DRAWS} times each with a few KiB held first ({mib(replays)} MiB, the draws' median, "
                    "weighed as one run)")
    notes.append(f"resident set at batch {batch}: {at / 2**20:.0f} MiB, the fit's {line / 2**20:.0f} MiB drawn "
                 f"{n}/{n + 1} of the way to the mean of {' and '.join(what)}")

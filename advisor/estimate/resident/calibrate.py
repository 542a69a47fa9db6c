"""Short real runs on this CPU that calibrate the estimate (only when the target is this CPU).

Fresh-process runs (advisor.measure) at batch sizes at most half the one asked for: `trace` runs trace
the step on real tensors, which replace the fake traces where the two disagree (a kernel workspace fake
tensors cannot know of, such as oneDNN's RNN); an `alloc` run's profiler events give the bytes kernels
allocate inside themselves; `rss` runs measure the resident set (docs/design.md, "what a measured peak
means") for the line fitted in fit.py, under a scaled glibc mmap threshold where the batch lies across it
from them (threshold.py), and log their heap for a replay at the batch (heaplog.py).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np

from advisor.estimate.batchmodel import BatchModel
from advisor.estimate.model import EstimateRequest
from advisor.estimate.resident.calibration import Calibration, Run
from advisor.estimate.resident.fit import fit_resident, from_an_eighth
from advisor.estimate.resident.threshold import run_mmap_threshold, threshold_target
from advisor.estimate.strategy import persistent_transient, scaled_curve
from advisor.estimate.trace import ACTIVATIONS, INPUTS, Trace, load_trace
from advisor.measure import MeasureRequest, MeasureResult, measure
from advisor.procmem import available_bytes

# Real and fake traces agree when their peaks and activation peaks differ by less than this.
AGREEMENT = 0.02
# Batch sizes under this get AT_BATCH_RUNS calibration runs at the batch itself too: from 2 up, the
# runs at a fraction of it reach a few samples at most (8: 2, 3 and 4), and where a heap chunk's reuse
# changes between those and the batch no line through them shows it; runs there are cheap.
AT_BATCH_BELOW = 16
AT_BATCH_RUNS = 2
# Real runs at a batch go only where its predicted resident set is at most this share of this host's
# memory (two run at once): cheap, no risk to the host.
HOST_SHARE = 0.3
# Resident-set runs at the largest calibration batch where none run at the batch itself: the fit extrapolates
# from there (to twice it), so one run's noise there is the estimate's, doubled. Two runs halve that run's
# weight, and how far they differ enters the fit's noise, which draws the slope toward its prior (fit.fit_line).
# Evidence: bench/estimate_accuracy.py --set fresh, bench/results/accuracy-fresh.json
TOP_RUNS = 2
# A replay at a batch holds about what a run there holds: up to this many times its live tensor peak (1.12-1.23
# over 0.5 GiB of live peak, up to 2.3 on small models, where the process's own libraries weigh most). The guard
# matters only for large batches: there 1.5 leaves room.
# Evidence: bench/estimate_accuracy.py, bench/results/accuracy-fp32.json
REPLAY_OVER_LIVE = 1.5


def calibration_batches(batch: int) -> tuple[int, ...]:
    """Up to three distinct batch sizes at most half of `batch` (samples); (1,) for batch <= 3.
    Batch 1 only below batch 8 (from 8 to 15: three sizes from 2 up): at batch 1 kernels take other paths
    (the tracer traces it apart, see estimator._batch_model), and its resident set strays from the
    line through larger batches either way (unet fp32: 297 MiB at 1, 314 at 2, 473 at 4, so a fit
    over 1, 2 and 4 says 0.76 resident bytes per transient byte where 2-8 say 1.2-1.3)."""
    sizes = sorted({max(1, batch // 8), max(1, batch // 4), max(1, batch // 2)})
    if sizes[0] == 1 and len(sizes) == 3:  # 8 <= batch < 16: three runs from 2 up
        sizes = sorted({max(2, batch // 4), (max(2, batch // 4) + batch // 2) // 2, batch // 2})
    return tuple(sizes)


def host_memory_bytes() -> int:
    """This host's physical memory (bytes): what real runs here share."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def top_runs(at_batch: int) -> int:
    """How many resident-set runs go at the largest of `calibration_batches`: TOP_RUNS, or one where
    `at_batch` runs go at the batch itself (`runs_at_batch`), which anchor the estimate there."""
    return 1 if at_batch else TOP_RUNS


def runs_at_batch(batch: int, predicted: int) -> int:
    """How many calibration runs go at `batch` itself beside those at fractions of it (calibration_batches),
    for a batch whose resident set is predicted `predicted` bytes before any run: AT_BATCH_RUNS in all
    under AT_BATCH_BELOW where that is cheap on this host (HOST_SHARE), else none."""
    if batch >= AT_BATCH_BELOW or predicted > HOST_SHARE * host_memory_bytes():
        return 0
    return AT_BATCH_RUNS - (batch in calibration_batches(batch))


def _request(spec: str, args: dict[str, Any], req: EstimateRequest, b: int, mode: str, path: str | None = None,
             mmap_threshold: int | None = None, heap_log: str | None = None):
    return MeasureRequest(workload=spec, workload_args=args, batch_size=b, precision=req.precision,
                          optimizer=req.optimizer, checkpointing=req.checkpointing,
                          fused_backward=req.fused_backward, mode=mode, trace_path=path, mmap_threshold=mmap_threshold,
                          heap_log=heap_log)


def _rss_jobs(spec: str, args: dict[str, Any], req: EstimateRequest, runs, target: int | None,
              logs: str | None = None) -> dict[Any, MeasureRequest]:
    """Resident-set runs keyed by `runs`' keys (their second item: the batch size), standing in for batch
    `target` (`run_mmap_threshold`), or under glibc's default where `target` is None; each logging its
    allocations into the directory `logs` where given (heaplog)."""
    return {r: _request(spec, args, req, r[1], "rss",
                        mmap_threshold=None if target is None else run_mmap_threshold(r[1], target),
                        heap_log=None if logs is None else os.path.join(logs, f"run{i}.heaplog"))
            for i, r in enumerate(runs)}


def replays_heap(at_batch: int, target: int | None) -> bool:
    """Whether the calibration's resident-set runs log their allocations for a replay at the batch (heaplog):
    where none runs at the batch itself (`at_batch`, those measure it), none fixes glibc's mmap threshold
    (`target`: a run that does stands in for another allocator regime than its log replays), and the logger
    and replayer can be built here."""
    from advisor.estimate.resident import heaplog

    return at_batch == 0 and target is None and heaplog.tools() is not None


def replay_at_batch(bm: BatchModel, batch: int, results: list[MeasureResult]) -> tuple[tuple[int, int], ...]:
    """((batch, resident-set increase in bytes),) from the logged runs among `results` (heaplog.replay_at, each
    run's tensor sizes mapped to the batch's by the batch model; their draws pooled, heaplog.pooled), or () where none
    could say: no log, or a trace whose kernels leave pages unwritten (oneDNN's RNN workspace: the replay
    writes every byte it asks for), or one of formulas; or should not: a batch whose live peak, REPLAY_OVER_LIVE
    times over, takes more than HOST_SHARE of this host's memory (two replays run at once, as runs do)."""
    from advisor.estimate.resident import heaplog

    at = bm.at(batch)
    if at.synthetic or (at.untouched is not None and bool(np.any(at.untouched))):
        return ()
    if REPLAY_OVER_LIVE * at.peak_bytes > HOST_SHARE * host_memory_bytes():  # a replay holds what the batch holds
        return ()

    def draws(r: MeasureResult) -> heaplog.Replayed | None:
        log, run = r.request.heap_log, bm.at(r.request.batch_size)
        if not log or not os.path.exists(log) or not os.path.getsize(log) or len(run.sizes) != len(at.sizes):
            return None
        try:
            return heaplog.replay_at(log, int(r.rss_delta_bytes or 0), r.request.mmap_threshold, run.sizes, at.sizes,
                                     phases=run.phases)
        except (OSError, ValueError, subprocess.SubprocessError):
            return None

    with ThreadPoolExecutor(max_workers=2) as pool:
        replayed = [p for p in pool.map(draws, results) if p is not None]
    return ((batch, heaplog.pooled(replayed)),) if replayed else ()


def _rss_point(r: MeasureResult) -> Run:
    return r.request.batch_size, int(r.rss_delta_bytes or 0), r.request.mmap_threshold


def _run_parallel(jobs: dict[Any, MeasureRequest]) -> dict[Any, MeasureResult]:
    """Two at a time, each told so (`measure`'s beside_another) and capped at its share of the memory this
    host has available now (`MeasureRequest.memory_cap_bytes`, where a job sets none): a run that outgrows
    it fails, and the estimate says it is not calibrated, where the OOM killer would have taken what it
    chose (a profiled run of a BiLSTM tagger at batch 24 can grow to 23 GB)."""
    at_once = min(2, len(jobs))
    available = available_bytes()
    if available is not None:
        cap = {"memory_cap_bytes": available // at_once}
        jobs = {k: j if j.memory_cap_bytes is not None else j.model_copy(update=cap) for k, j in jobs.items()}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {k: pool.submit(measure, j, beside_another=at_once > 1) for k, j in jobs.items()}
        return {k: f.result() for k, f in futures.items()}


def _trace_batches(batch: int, at_batch: bool = False) -> tuple[int, int]:
    """Real traces at a quarter and a half of the batch: the closer to the full batch, the likelier
    kernels take the paths they will take there (oneDNN picks RNN and conv algorithms by shape).
    `at_batch` (a small batch whose runs go at the batch itself, `runs_at_batch`): at half of it and
    the batch, so the batch's own allocations are traced, not extrapolated from batch 1's and 2's (a
    seq2seq nn.Transformer's exact live peaks are 248.5, 248.7, 274 and 310 MiB at 1-4, and real
    traces at 1 and 2 put the one at 4 at 249)."""
    if at_batch and batch >= 3:
        return (batch // 2, batch)
    hi = max(2, batch // 2)
    return (max(1, hi // 2), hi)


def real_batch_model(spec: str, args: dict[str, Any], req: EstimateRequest, batches: tuple[int, int],
                     extra: dict[Any, MeasureRequest] | None = None) -> tuple[BatchModel, dict[Any, MeasureResult]]:
    """A BatchModel from real-tensor traces at two batch sizes, plus any extra runs done alongside."""
    with tempfile.TemporaryDirectory(prefix="advisor-cal-") as tmp:
        jobs = {("trace", b): _request(spec, args, req, b, "trace", os.path.join(tmp, f"t{b}.npz")) for b in batches}
        jobs.update(extra or {})
        res = _run_parallel(jobs)
        traces = {b: load_trace(os.path.join(tmp, f"t{b}.npz")) for b in batches}
    lo, hi = batches
    return BatchModel(a=lo, trace_a=traces[lo], c=hi, trace_c=traces[hi]), res


def _agree(fake: Trace, real: Trace) -> bool:
    def act(t: Trace) -> int:
        return int((t.curve[:, ACTIVATIONS] + t.curve[:, INPUTS]).max())

    def close(x: int, y: int) -> bool:
        return abs(x - y) <= AGREEMENT * max(y, 1) + 1_000_000

    return close(fake.peak_bytes, real.peak_bytes) and close(act(fake), act(real))


def calibrate_cpu(spec: str, args: dict[str, Any], req: EstimateRequest, bm: BatchModel,
                  scale_threshold: bool | None = None, at_batch: int = 0) -> tuple[Calibration, BatchModel]:
    """Fit the CPU runtime overhead; returns it and the batch model to use (fake, or real traces).
    `scale_threshold`: whether the resident-set runs fix glibc's mmap threshold at their share of the
    batch (`run_mmap_threshold`); None: where the batch lies across it from them (`crosses`).
    `at_batch`: resident-set runs at the batch itself besides (`runs_at_batch`), under glibc's default
    as a user runs it; they join the fit, and the estimate at the batch leans on them (`Calibration.at_batch`).
    Without them, the largest calibration batch runs `top_runs` times."""
    rss_batches = calibration_batches(req.batch_size)
    trace_batches = _trace_batches(req.batch_size, at_batch > 0)
    target = threshold_target(req, bm, rss_batches, req.batch_size) if scale_threshold is None \
        else req.batch_size if scale_threshold else None
    runs = [("rss", b) for b in rss_batches] \
        + [("rss", rss_batches[-1], "again", i) for i in range(1, top_runs(at_batch))] \
        + [("rss", req.batch_size, i) for i in range(at_batch)]
    with tempfile.TemporaryDirectory(prefix="advisor-heap-") as logs:
        jobs = _rss_jobs(spec, args, req, runs, target, logs if replays_heap(at_batch, target) else None)
        jobs[("alloc", trace_batches[1])] = _request(spec, args, req, trace_batches[1], "alloc")
        real_bm, res = real_batch_model(spec, args, req, trace_batches, jobs)
        calib, chosen = _calibration(req, bm, real_bm, res, runs, trace_batches[1])
        return replace(calib, replayed=replay_at_batch(chosen, req.batch_size, [res[r] for r in runs])), chosen


def _calibration(req: EstimateRequest, bm: BatchModel, real_bm: BatchModel, res: dict[Any, MeasureResult],
                 runs: list, hi: int) -> tuple[Calibration, BatchModel]:
    """The fit over the runs `res` holds (keyed by `runs`; an alloc run at `hi`), and the batch model chosen."""
    # A fake trace whose kernel workspaces were sized by real runs at the full shapes stands: the real
    # traces cannot see scratch a kernel frees inside itself, and extrapolate from small batches. Each is
    # compared at the real trace's batch itself (BatchModel.traced): the data's shapes need not scale with it.
    sized = bm.trace_a.sized_kernels or bm.trace_a.probed_reductions or bm.trace_a.probed_products
    use_real = not sized and not all(_agree(bm.traced(b), real_bm.at(b)) for b in (real_bm.a, real_bm.c))
    chosen = real_bm if use_real else bm
    _, transient_hi = persistent_transient(scaled_curve(req, chosen.at(hi), 1))
    hidden = max(0, (res[("alloc", hi)].alloc_peak_bytes or 0) - chosen.at(hi).peak_bytes)
    ratio = hidden / transient_hi if transient_hi else 0.0
    rss = tuple(_rss_point(res[r]) for r in runs)
    return Calibration(**fit_resident(req, chosen, ratio, rss)._asdict(), hidden_ratio=ratio,
                       batches=tuple(sorted({b for b, _, _ in rss})),
                       used_real_traces=use_real, rss=rss), chosen


def recalibrate_near(spec: str, args: dict[str, Any], req: EstimateRequest, bm: BatchModel, first: Calibration,
                     batch: int) -> Calibration | None:
    """A second round of resident-set runs at `batch` (a predicted largest batch far from the first round's)
    and half of it, fitted with the first round's runs from an eighth of `batch` up: the fit then brackets
    the batch sizes it is asked about instead of extrapolating from small ones, whose resident set follows
    other rules (glibc's heap keeps freed chunks under 32 MiB; larger ones are mapped and unmapped). The
    batch model stays: tensor sizes extrapolate exactly, the resident set does not. `batch` runs twice under
    glibc's default (measured peaks as a user would see them), half of it with the mmap threshold halved
    where `batch` lies across it (`run_mmap_threshold`, `crosses`): how far two identical runs differ joins
    the fit's spread, which the largest batch keeps clear of the cap. None where the first round ran at `batch`."""
    if batch in first.batches:
        return None
    runs = [("rss", b, i) for b in sorted({max(1, batch // 2), batch} - set(first.batches))
            for i in range(1 + (b == batch))]
    res = _run_parallel(_rss_jobs(spec, args, req, runs, threshold_target(req, bm, (max(1, batch // 2),), batch)))
    rss = from_an_eighth(first.rss, batch) + tuple(_rss_point(res[r]) for r in runs)
    return Calibration(**fit_resident(req, bm, first.hidden_ratio, rss)._asdict(), hidden_ratio=first.hidden_ratio,
                       batches=tuple(sorted({b for b, _, _ in rss})), used_real_traces=first.used_real_traces,
                       rss=rss, replayed=first.replayed)

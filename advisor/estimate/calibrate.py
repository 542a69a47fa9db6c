"""Short real runs on this CPU that refine the estimate (only when the target is this CPU).

Two kinds of fresh-process runs (advisor.measure), at batch sizes at most half the one asked for:
- `trace`: the estimator's tracer on real tensors, so real kernels pick their own paths. Where
  real and fake traces disagree (a kernel keeps a workspace fake tensors cannot know of, such as
  oneDNN's RNN), the real traces replace the fake ones, extrapolated per allocation in batch size.
- `alloc`: the exact live-bytes peak from the profiler's allocator events, which also sees buffers
  kernels allocate inside themselves; the excess over the trace scales with the transient bytes.
- `rss`: DESIGN.md's resident-set protocol. The peak resident set beyond the persistent tensors
  is fitted as affine in the transient peak of the same batch (see overhead.py for why). Where the
  batch lies across glibc's mmap threshold from the runs (`crosses`), a run at a share of the batch
  runs with the threshold at that share of its 32 MiB maximum (`run_mmap_threshold`), so the
  tensors glibc will map on their own at the batch are mapped in the run too, and the ones it will
  serve from its heap are heap-served there.
The same real traces stand in for the fake one for a model that cannot be traced at all.
"""

from __future__ import annotations

import math
import os
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from advisor.estimate.batchmodel import BatchModel
from advisor.estimate.model import EstimateRequest
from advisor.estimate.overhead import CPU_DEFAULT, CpuCalibration
from advisor.estimate.strategy import (MMAP_FROM_BYTES, MMAP_THRESHOLD_MAX, mmap_from,
                                       persistent_transient, resident_terms, scaled_curve)
from advisor.estimate.trace import ACTIVATIONS, INPUTS, Trace, load_trace
from advisor.measure import MeasureRequest, MeasureResult, measure
from advisor.procmem import available_bytes

# One resident-set run, or measured peak: (batch size, resident-set increase in bytes, the glibc mmap
# threshold it fixed (bytes; `run_mmap_threshold`), or None where glibc's dynamic default ran).
Run = tuple[int, int, int | None]

# Real and fake traces agree when their peaks and activation peaks differ by less than this.
AGREEMENT = 0.02


@dataclass(frozen=True)
class Calibration(CpuCalibration):
    batches: tuple[int, ...] = ()
    used_real_traces: bool = False
    rss: tuple[Run, ...] = ()
    # (batch size, resident-set increase in bytes) that the runs' own allocations, rescaled to that batch and
    # replayed through glibc, put there (`replay_at_batch`): one more run at the batch, for `at_batch`
    replayed: tuple[tuple[int, int], ...] = ()

    def margin(self, resident: float) -> float:
        """What the largest batch keeps clear of the cap at a batch whose resident set is predicted
        `resident` (bytes): the fit's spread, or `noise_share` of `resident` where wider (a run's noise
        grows with what is resident, and the answer's resident set is larger than the runs' where it
        lies past them): a fit through two points passes within bytes of both, yet the next run strays
        as far as runs do here."""
        return max(self.spread, self.noise_share(resident) * resident) if self.rss else self.spread

    def noise_share(self, resident: float = 0.0) -> float:
        """How far a run at the answer may come out above the fit, as a share of its resident set
        `resident` (bytes): the share that two runs at one batch size differ by, pooled over the batch sizes
        that ran more than once (`repeat_noise`), and at least UNREPEATED_NOISE, what single runs stray by
        across workloads (both as `noise_scale` takes them to a larger resident set): two runs that agree say
        little of the next one.
        mlp under 1.5 GB (session 22, Intel VM), twice: two runs at 25308 (25416) close together, so
        RUN_NOISE (28 MiB) kept clear, and the fit answered 27225 (27372), where the bench's runs
        measured over the cap and at the real largest batch 26714 (26858) they spread 3-5.5%.
        tiny-gpt2 uncalibrated with one real peak at 32 and one at 128, under a cap of 1.5x the
        larger, with RUN_NOISE kept clear: the median of 3 runs at the answer came out 0.7 MB over
        (CI, 2026-11-25) and 1.7 MB over (session 21's AMD VM) a 257-271 MB cap."""
        return self.runs_share(1, resident)

    def runs_share(self, k: int, resident: float = 0.0) -> float:
        """What a batch whose own k runs (1 or more) vouch for it keeps clear above the highest of them,
        as a share of it, at a resident set of `resident` bytes: MAX_OF_RUNS_NOISE for k runs, or the runs'
        `repeat_noise` where wider, each as `noise_scale` takes it there."""
        share = MAX_OF_RUNS_NOISE[min(k, len(MAX_OF_RUNS_NOISE)) - 1] * noise_scale(NOISE_REF_BYTES, resident)
        return max(share, self.repeat_noise(resident))

    def repeat_noise(self, resident: float = 0.0) -> float:
        """How far two runs at one batch size under glibc's default differ, as a share of their median, from
        every batch size that ran more than once (0 where none did): the runs' standard deviation as a share
        of their median, pooled over those batch sizes (each weighed by its runs less one), times sqrt(2),
        so that one pair gives its own range; each share taken to a resident set of `resident` bytes from
        its runs' (`noise_scale`). The noise of this workload's runs seen directly, where it exceeds
        UNREPEATED_NOISE.
        resnet18 at 64 px under 1.5 GB (session 21): runs at 433 measured 1374 and 1442 MiB (4.8%), the fit
        through them answered 428 with its 38 MiB spread kept clear, and the bench's three runs at 428 then
        measured 1470-1547 MiB, over the cap. mlp under 1.5 GB (session 37): its two runs at 4096 came out
        14% apart at ~0.4 GB, and 14% of the answer's resident set kept 174 MiB clear, where runs at 25758
        spread 3%: 0.884 of the real largest batch.
        Pooled, not the widest range: within a workload a run's noise, as a share, is one trait across batch
        sizes (bench/range_law.py over the benches' 796 pairs of three-run sets of one case at two batch
        sizes: the larger batch's range is 1.06-1.23 times the smaller's at the median, for resident sets
        1.0-3.4 times as large), so every repeated batch size measures it, and the widest of several ranges
        grows with how many batch sizes ran twice. resnet18 under 1.5 GB (session 54, an Intel VM): pairs at
        128, 357 and 407 of 2.0%, 2.2% and 7.9% (1430 and 1548 MiB); the widest kept 104 MiB clear and the
        answer was 361, 0.885 of the real 408."""
        num = den = 0.0
        for rs in self.default_runs().values():
            if len(rs) > 1:
                median = float(np.median(rs))
                share = float(np.std(rs, ddof=1)) / median * noise_scale(median, resident)
                num, den = num + (len(rs) - 1) * share ** 2, den + len(rs) - 1
        return math.sqrt(2 * num / den) if den else 0.0

    def default_runs(self) -> dict[int, list[int]]:
        """The resident-set runs under glibc's default allocator, as the user's run will be, by batch
        size (bytes): calibration runs, near rounds', measured peaks."""
        by_batch: dict[int, list[int]] = {}
        for b, resident, threshold in self.rss:
            if threshold is None:
                by_batch.setdefault(b, []).append(resident)
        return by_batch

    def runs_at(self, b: int) -> list[int]:
        """The resident-set increases of the runs at batch b itself under glibc's default allocator,
        as a user runs it (bytes): calibration runs at the batch, a near round's, measured peaks."""
        return self.default_runs().get(b, [])

    def at_batch(self, b: int, line: float) -> float:
        """The resident set at batch b (bytes): the fit's `line` there, drawn toward the mean of the
        runs at b itself by n / (n + 1) for n runs (the posterior mean where the fit's error at b and
        one run's noise are alike: on session 20's grid the line strayed 2.4% at the median, 10% at
        most, and one run strayed from its case's other two 1.5% at the median, up to 19%). The line
        alone cannot bend where the heap's reuse of freed chunks changes between the runs below b and
        b itself (unseen audio net at 8: runs at 2-4 on a line that the runs at 8 sit 20-55 MiB above).
        A replay of the runs' heap at b (`replayed`) counts as one run there: it can bend where the line
        cannot."""
        rs = self.runs_at(b) + [r for x, r in self.replayed if x == b]
        if not rs:
            return line
        return line + len(rs) / (len(rs) + 1) * (float(np.mean(rs)) - line)


def calibration_batches(batch: int) -> tuple[int, ...]:
    """Up to three distinct batch sizes at most half of `batch` (samples); (1,) for batch <= 3.
    Batch 1 only below batch 8 (from 8 to 15: three sizes from 2 up): at batch 1 kernels take other paths
    (the tracer traces it apart, see estimator._batch_model), and its resident set strays from the
    line through larger batches either way (unet fp32 here: 297 MiB at 1, 314 at 2, 473 at 4, so a
    fit over 1, 2 and 4 says 0.76 resident bytes per transient byte where 2-8 say 1.2-1.3)."""
    sizes = sorted({max(1, batch // 8), max(1, batch // 4), max(1, batch // 2)})
    if sizes[0] == 1 and len(sizes) == 3:  # 8 <= batch < 16: three runs from 2 up
        sizes = sorted({max(2, batch // 4), (max(2, batch // 4) + batch // 2) // 2, batch // 2})
    return tuple(sizes)


# Batch sizes under this get AT_BATCH_RUNS calibration runs at the batch itself too: from 2 up, the
# runs at a fraction of it reach a few samples at most (8: 2, 3 and 4), and where a heap chunk's reuse
# changes between those and the batch no line through them shows it; runs there are cheap.
AT_BATCH_BELOW = 16
AT_BATCH_RUNS = 2
# Real runs at a batch go only where its predicted resident set is at most this share of this host's
# memory (two run at once): cheap, no risk to the host.
HOST_SHARE = 0.3


def host_memory_bytes() -> int:
    """This host's physical memory (bytes): what real runs here share."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# Resident-set runs at the largest calibration batch where none run at the batch itself: the fit
# extrapolates from there (to twice it), so one run's noise there is the estimate's, doubled. vae fp32
# sgd-momentum b32 (fresh set, session 27, Intel VM): runs at 4, 8, 16 measured 203, 219, 272 MiB and
# the estimate came out +12.9%; calibrated again on new runs (205, 220, 255 MiB) +0.9%: one run 17 MiB
# higher at 16 had turned the slope from 1.62 to 2.14. Two runs there halve that run's weight, and how
# far they differ enters the fit's noise, which draws the slope toward its prior (`_fit`).
TOP_RUNS = 2


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


# glibc's initial mmap threshold (DEFAULT_MMAP_THRESHOLD_MIN): no run fixes one lower.
MMAP_THRESHOLD_MIN = 128 * 1024


def run_mmap_threshold(b: int, target: int) -> int | None:
    """glibc's mmap threshold for a resident-set run at batch b that stands in for batch `target`
    (bytes), or None (glibc's dynamic default) where b is the target or more. glibc maps a request
    of 32 MiB and up on its own and unmaps it when freed, but serves smaller ones from its heap once
    its dynamic threshold has risen past them, and a freed heap chunk stays resident. A tensor that
    grows with the batch is b/target of its size at the target in the run, so the run's threshold is
    b/target of 32 MiB: what the target maps, the run maps. With glibc's default in the runs, an
    mlp at b4096 (32 MiB activations, mapped) was calibrated at 512-2048 (4-16 MiB, heap-served,
    2.2 resident bytes per transient byte) and came out +20 to +35%; with the threshold scaled,
    +6 to +7% (BENCHMARKS.md, calibration section)."""
    if b >= target:
        return None
    return max(MMAP_THRESHOLD_MIN, MMAP_THRESHOLD_MAX * b // target)


def threshold_target(req: EstimateRequest, bm: BatchModel, batches, target: int) -> int | None:
    """`target` where runs at `batches` under glibc's default would lie across its mmap threshold
    from it (`crosses`), so their thresholds scale to it; else None: they run as a user runs them. A
    lowered threshold also maps what does not grow with the batch: dlrm's 24 MiB embedding tables'
    optimizer temporaries, heap-served at its b2048, were mapped in runs at 256-1024 whose threshold
    was 4-16 MiB, and the estimate went from -1.9% to -7.6% (BENCHMARKS.md, session 13)."""
    return target if crosses(req, bm, tuple((b, 0, None) for b in batches), target) else None


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
    from advisor.estimate import heaplog

    return at_batch == 0 and target is None and heaplog.tools() is not None


# A replay at a batch holds about what a run there holds: up to this many times its live tensor peak.
# Measured (session 39, the replay's predictions in three bench runs of sessions 38-39, 40 cases): 1.12-1.23
# times where the live peak is over 0.5 GiB (dlrm, vit-b16, pointnet, simclr, fp32 and bf16), up to 2.3 on
# small models (mlp, resnet18, ftt, convnext: 130-410 MiB), where the process's own libraries, which the
# prediction counts and a replayer does not hold, weigh most. The guard matters only for large batches:
# there 1.5 leaves room.
REPLAY_OVER_LIVE = 1.5


def replay_at_batch(bm: BatchModel, batch: int, results: list[MeasureResult]) -> tuple[tuple[int, int], ...]:
    """((batch, resident-set increase in bytes),) from the logged runs among `results` (heaplog.replay_at, each
    run's tensor sizes mapped to the batch's by the batch model; their draws pooled, heaplog.pooled), or () where none
    could say: no log, or a trace whose kernels leave pages unwritten (oneDNN's RNN workspace: the replay
    writes every byte it asks for), or one of formulas; or should not: a batch whose live peak, REPLAY_OVER_LIVE
    times over, takes more than HOST_SHARE of this host's memory (two replays run at once, as runs do)."""
    from advisor.estimate import heaplog

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
    chose (session 48: the profiled run of a BiLSTM tagger at batch 24 grew to 23 GB and was killed)."""
    at_once = min(2, len(jobs))
    available = available_bytes()
    if available is not None:
        jobs = {k: j if j.memory_cap_bytes is not None else j.model_copy(update={"memory_cap_bytes": available // at_once})
                for k, j in jobs.items()}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {k: pool.submit(measure, j, beside_another=at_once > 1) for k, j in jobs.items()}
        return {k: f.result() for k, f in futures.items()}


def _trace_batches(batch: int, at_batch: bool = False) -> tuple[int, int]:
    """Real traces at a quarter and a half of the batch: the closer to the full batch, the likelier
    kernels take the paths they will take there (oneDNN picks RNN and conv algorithms by shape).
    `at_batch` (a small batch whose runs go at the batch itself, `runs_at_batch`): at half of it and
    the batch, so the batch's own allocations are traced, not extrapolated from batch 1's and 2's (a
    seq2seq nn.Transformer, session 21: its exact live peaks are 248.5, 248.7, 274 and 310 MiB at 1-4,
    and real traces at 1 and 2 put the one at 4 at 249)."""
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


# Bounds on resident bytes per transient live byte: the fit extrapolates, and noise in a
# resident set must not turn into a wild slope.
SLOPE_BOUNDS = (0.5, 2.5)
# The least noise assumed in one run's resident set, as a share of it: identical runs here differ
# by 1-6% (vit-b16 1.631-1.642 GB, bert-base 2.190-2.220, gpt2-small 2.444-2.602, mlp 0.406-0.433).
RUN_NOISE = 0.02
# How far one run's resident set may lie below the median of three identical runs, as a share of that
# median: what the largest batch keeps clear at least (Calibration.noise_share). The 95th percentile
# over the benches' 224 cases of three runs each (bench/results/accuracy*.json: the grids of sessions
# 15 and 21, the unseen and fresh sets; Intel and AMD VMs: median 1.0%, 90th percentile 4.2%, 95th
# 5.0%, largest 14%). A fit through runs that came out that low sits that far under the median the
# user's run will see.
UNREPEATED_NOISE = 0.05
# How far the median of three fresh runs may come out above the highest of k runs at one batch size, as a
# share of it, for k = 1, 2, 3 and more: what a batch whose own runs vouch for it keeps clear
# (Calibration.runs_share). One run: UNREPEATED_NOISE. The highest of several strays less: over the
# benches' 760 distinct sets of three runs (bench/run_noise.py), at the percentile where one run's excess
# reaches UNREPEATED_NOISE (96-97th), two runs' reaches 2.1-2.53% and three runs' 1.5% (pooled shares, and
# normal with each case's own spread; the larger, rounded up). gpt2-small at seq 64 under 2.5 GB
# (session 33): the near round's two runs at 15 were not clear of the cap less 5%, so it answered 14;
# the real largest batch is 16 (its runs 2464-2504 MB).
MAX_OF_RUNS_NOISE = (UNREPEATED_NOISE, 0.026, 0.015)
# A run's noise as a share of its resident set shrinks as the resident set grows. Over the benches' 851
# distinct sets of three runs (bench/results/accuracy*.json, CPU; `bench/run_noise.py --by-size`), the 95th
# percentile of a run's shortfall below its set's median falls from 4.6% at 0.29 GB to 2.2% at 2.3 GB (eight
# bins of ~106 sets: a power law of exponent -0.33, 3.0% at 1 GB), and of a set's range from 14% to 5.4%
# (exponent -0.49). The shares above hold up to NOISE_REF_BYTES, where they stand above that percentile
# (5% against 3.0%), and shrink as resident^-NOISE_EXPONENT past it; a range seen at one batch size shrinks
# the same way from its runs' resident set to a larger one (taken as NOISE_LAW_FROM where smaller: no set
# under it was measured enough to say how the share goes there), and never grows to a smaller one.
NOISE_REF_BYTES = 1e9
NOISE_LAW_FROM = 0.25e9
NOISE_EXPONENT = 1 / 3


def noise_scale(seen: float, resident: float) -> float:
    """What a noise share seen at a resident set of `seen` bytes becomes at `resident` bytes (at most 1)."""
    seen = max(seen, NOISE_LAW_FROM)
    return 1.0 if resident <= seen else (seen / resident) ** NOISE_EXPONENT


# Where a calibration's runs say little of the slope, it is drawn toward this one: the median slope
# of calibrations here (the accuracy grid's 32 from batch 16 up, session 23: 1.16). Not the
# uncalibrated default's (overhead.CPU_DEFAULT, median 1.53), fitted through runs from an eighth of a
# batch to the batch itself: across that range the resident set grows more per transient byte than
# within a calibration's runs, which lie within a few times of each other.
SLOPE_PRIOR_MEAN = 1.15
# How far a workload's slope strays from the prior's: fitted slopes span 0.5-1.9 across presets.
SLOPE_PRIOR_SD = 0.35


def slope_precision(sxx: float, noise_var: float) -> float:
    """1 / variance of the resident-set slope's posterior: the runs' centred transient spread `sxx`
    (bytes^2) over their noise variance, plus the normal prior's (SLOPE_PRIOR_SD about its mean)."""
    return sxx / noise_var + 1.0 / SLOPE_PRIOR_SD ** 2


# Where a calibration's runs grow faster than their transient bytes explain, the resident set may grow with
# something else: the bytes each step allocates and frees, which grow with the batch. ckpt
# (bench/workloads/kinds.py: eight 16 MiB-weight MLP blocks, half of them checkpointed), fp32 sgd-momentum b16,
# session 34's Zen 3 VM: runs at 2, 4, 8, 8 rose 138, 174, 257, 256 MiB above their persistent tensors while
# the heap-served transient peak rose 5, 10, 20, 20 MiB: 8.2 resident bytes per transient byte, 4.4 SDs above
# the prior's 1.15. Its resident set grows ~20 MiB per sample from 2 to 32 (glibc's heap held 172 MiB free at
# batch 8 and 315 MiB at 16 after a backward, mallinfo2), not with the few its weights-bound peak adds; the
# posterior's slope of 1.49 put batch 16 at -13% to -15% (sessions 29-33). The slope's prior is taken as a
# mixture: the normal one, and with GROWTH_PRIOR a broad one (GROWTH_SD) for such workloads; the fit is the
# two fits' blend, each weighted by how likely the runs' own slope is under it (`growth_weight`). A hard switch
# at 2 SDs (session 34's first try) jumped: vit-b16 fp32 sgd-momentum b16, 2.2 SDs steep, came out ~90 MiB
# higher than its posterior's line.
GROWTH_PRIOR = 0.1  # two of the kinds set's eight workloads (ckpt, moe) grew this way in session 34's runs
GROWTH_SD = 5.0  # resident bytes per transient byte: ckpt's runs said 8-20


def growth_weight(free: float, prior: float, sxx: float, noise_var: float) -> float:
    """The weight (0-1) of the per-sample fit in `_fit`: the posterior probability that the runs' own slope `free`
    (its variance noise_var / sxx) came from the broad prior (GROWTH_PRIOR, GROWTH_SD about `prior`) rather
    than the normal one (SLOPE_PRIOR_SD). Only where it is steeper than `prior`: a shallower slope stays drawn
    toward it and bounded, since the runs' heap may reuse more at larger batches, and an estimate under the
    resident set is the one that fails a run."""
    if free <= prior:
        return 0.0
    se2 = noise_var / sxx

    def density(sd2: float) -> float:
        return float(np.exp(-0.5 * (free - prior) ** 2 / sd2) / np.sqrt(sd2))

    narrow, broad = (1 - GROWTH_PRIOR) * density(se2 + SLOPE_PRIOR_SD ** 2), GROWTH_PRIOR * density(se2 + GROWTH_SD ** 2)
    return broad / (narrow + broad)


class Fit(NamedTuple):
    """A resident-set fit: extra = intercept + slope x transient + per_sample x batch (bytes)."""
    intercept: float
    slope: float
    spread: float  # the largest distance of a run from the fit (bytes)
    per_sample: float = 0.0


def _fit(transient: list[int], extra: list[float], resident: list[int],
         prior: float = SLOPE_PRIOR_MEAN, batches: list[int] | None = None) -> Fit:
    """extra = intercept + slope x transient, by least squares with the slope drawn toward `prior`
    (the posterior mean under a normal prior on it): where the runs' transient bytes span
    little next to their noise, they say little about the slope, and three single runs would
    otherwise hand the extrapolation whatever slope their noise suggests. The noise is the larger
    of RUN_NOISE of the runs' resident set and what the runs stray from a free fit. Where their `batches`
    are given and the runs' own slope is steeper than the prior's, the fit blends in, by `growth_weight`,
    one that keeps the prior's slope for the transient bytes and fits the rest of the runs' growth per
    sample of the batch. Also the
    largest distance of a run from the fit (bytes): how far one run of this workload strays here."""
    x, y = np.asarray(transient, float), np.asarray(extra, float)
    xc, yc = x - x.mean(), y - y.mean()
    noise_var = (RUN_NOISE * float(np.median(resident))) ** 2
    sxx = float(xc @ xc)
    free = None  # the runs' own least-squares slope, where they can say one
    if len(x) > 2 and sxx > 0:
        free = float(xc @ yc) / sxx
        noise_var = max(noise_var, float(((yc - free * xc) ** 2).sum()) / (len(x) - 2))
    slope = (float(xc @ yc) / noise_var + prior / SLOPE_PRIOR_SD ** 2) / slope_precision(sxx, noise_var)
    slope = float(np.clip(slope, *SLOPE_BOUNDS))
    intercept, per_sample = float(np.mean(y - slope * x)), 0.0
    n = np.asarray(batches if batches is not None else [0] * len(x), float)
    w = growth_weight(free, prior, sxx, noise_var) if free is not None and np.ptp(n) > 0 else 0.0
    if w > 0:  # blend in the prior's slope with the rest of the growth per sample (least squares, at least 0)
        grows = max(0.0, float(np.polyfit(n, y - prior * x, 1)[0]))
        intercept = (1 - w) * intercept + w * float(np.mean(y - prior * x - grows * n))
        slope, per_sample = (1 - w) * slope + w * prior, w * grows
    rest = y - slope * x - per_sample * n - intercept
    return Fit(intercept, slope, float(np.abs(rest).max()), per_sample)


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
    runs = [("rss", b) for b in rss_batches] + [("rss", rss_batches[-1], "again", i) for i in range(1, top_runs(at_batch))] \
        + [("rss", req.batch_size, i) for i in range(at_batch)]
    with tempfile.TemporaryDirectory(prefix="advisor-heap-") as logs:
        jobs = _rss_jobs(spec, args, req, runs, target, logs if replays_heap(at_batch, target) else None)
        jobs[("alloc", trace_batches[1])] = _request(spec, args, req, trace_batches[1], "alloc")
        real_bm, res = real_batch_model(spec, args, req, trace_batches, jobs)
        calib, chosen = _calibration(req, bm, real_bm, res, runs, trace_batches[1])
        return replace(calib, replayed=replay_at_batch(chosen, req.batch_size, [res[r] for r in runs])), chosen


def _calibration(req: EstimateRequest, bm: BatchModel, real_bm: BatchModel, res: dict[Any, MeasureResult], runs: list,
                 hi: int) -> tuple[Calibration, BatchModel]:
    """The fit over the runs `res` holds (keyed by `runs`; an alloc run at `hi`), and the batch model chosen."""
    # A fake trace whose kernel workspaces were sized by real runs at the full shapes stands: the
    # real traces cannot see scratch a kernel frees inside itself, and extrapolate from small batches.
    # each compared at the real trace's batch itself (BatchModel.traced): the data's shapes need not scale with it
    sized = bm.trace_a.sized_kernels or bm.trace_a.probed_reductions or bm.trace_a.probed_products
    use_real = not sized and not all(_agree(bm.traced(b), real_bm.at(b)) for b in (real_bm.a, real_bm.c))
    chosen = real_bm if use_real else bm
    _, transient_hi = persistent_transient(scaled_curve(req, chosen.at(hi), 1))
    hidden = max(0, (res[("alloc", hi)].alloc_peak_bytes or 0) - chosen.at(hi).peak_bytes)
    ratio = hidden / transient_hi if transient_hi else 0.0
    rss = tuple(_rss_point(res[r]) for r in runs)
    return Calibration(**_fit_resident(req, chosen, ratio, rss)._asdict(), hidden_ratio=ratio,
                       batches=tuple(sorted({b for b, _, _ in rss})),
                       used_real_traces=use_real, rss=rss), chosen


def _fit_resident(req: EstimateRequest, bm: BatchModel, ratio: float, rss: tuple[Run, ...],
                  prior: float = SLOPE_PRIOR_MEAN) -> Fit:
    """resident - persistent = intercept + slope x transient (+ per_sample x batch) over the runs, each
    run's allocations split into heap-served and mapped at the size its glibc mapped from; the slope
    drawn toward `prior` (`_fit`)."""
    split = [_split(req, bm, b, mmap_from(t)) for b, _, t in rss]
    # kernels' hidden buffers join the heap-served part; mapped allocations count once, at their own moments
    heap = [int(above + ratio * (h + m)) for _, h, m, _, above in split]
    extra = [r - p - over for (_, r, _), (p, _, _, over, _) in zip(rss, split)]
    return _fit(heap, extra, [r for _, r, _ in rss], prior, [b for b, _, _ in rss])


def _split(req: EstimateRequest, bm: BatchModel, b: int, mapped_from: int = MMAP_FROM_BYTES) -> tuple[int, int, int, int, int]:
    """strategy.resident_terms of batch b's curve."""
    tr = bm.at(b)
    return resident_terms(scaled_curve(req, tr, 1), tr.synthetic, tr.untouched, mapped_from)


# The share of a target's transient peak in mapped allocations from which a crossing is worth a warning.
MAPPED_REGIME_SHARE = 0.25


def mapped_share(req: EstimateRequest, bm: BatchModel, b: int, mapped_from: int = MMAP_FROM_BYTES) -> float:
    """The share of batch b's transient peak held by allocations glibc maps on their own (0-1), for
    a glibc that maps requests from `mapped_from` bytes up."""
    _, heap, mapped, _, _ = _split(req, bm, b, mapped_from)
    return mapped / (heap + mapped) if heap + mapped > 0 else 0.0


def _shares(req: EstimateRequest, bm: BatchModel, runs: tuple[Run, ...], b: int) -> tuple[float, list[float]] | None:
    """(batch b's mapped share under glibc's default, each run's under its own threshold), or None where
    b maps under MAPPED_REGIME_SHARE: then no run lies across the threshold from it."""
    share = mapped_share(req, bm, b)
    if share < MAPPED_REGIME_SHARE:
        return None
    return share, [mapped_share(req, bm, x, mmap_from(t)) for x, _, t in runs]


def _crossing(req: EstimateRequest, bm: BatchModel, runs: tuple[Run, ...], b: int) -> tuple[float, float] | None:
    """(batch b's mapped share under glibc's default, the largest of the runs' under their own thresholds)
    where b lies across glibc's mmap threshold from every run (`crosses`), else None."""
    shares = _shares(req, bm, runs, b) if runs else None
    if shares is None:
        return None
    share, ran = shares[0], max(shares[1])
    return (share, ran) if ran < share / 2 else None


def across_threshold(req: EstimateRequest, bm: BatchModel, points: tuple[Run, ...], b: int) -> tuple[Run, ...]:
    """The runs among `points` (measured peaks) that lie across glibc's mmap threshold from batch b, one
    by one as `crosses` asks of all: b maps at least MAPPED_REGIME_SHARE of its transient peak, the run
    under half that share under its own threshold. Their resident bytes per heap-served byte are the
    heap's regime, not b's."""
    shares = _shares(req, bm, points, b)
    if shares is None:
        return ()
    return tuple(p for p, ran in zip(points, shares[1]) if ran < shares[0] / 2)


def crosses(req: EstimateRequest, bm: BatchModel, runs: tuple[Run, ...], b: int) -> bool:
    """Whether batch b lies across glibc's mmap threshold from every resident-set run: at least
    MAPPED_REGIME_SHARE of its transient peak is mapped, and no run had half its share under its own
    threshold. A freed mapped allocation leaves the resident set and a freed heap chunk stays, so the
    runs' resident bytes per transient byte do not carry over."""
    return _crossing(req, bm, runs, b) is not None


def mapped_regime_note(req: EstimateRequest, bm: BatchModel, runs: tuple[Run, ...], b: int) -> str | None:
    """A warning when batch b lies across glibc's mmap threshold from every resident-set run
    (`Calibration.rss`; `crosses`): nothing the runs show says by how much their resident bytes per
    transient byte stop carrying over. On this project's VM the error there was +35% (mlp b4096,
    whose 32 MiB activations leave a heap that fragmented 2.2x at the runs' batch sizes) and -10% (a
    transformer encoder at b16, whose attention maps crossed at 32 MiB). Calibration runs that would
    cross scale the threshold (`run_mmap_threshold`) and do not; measured peaks at smaller batches,
    run as a user runs them, can."""
    crossing = _crossing(req, bm, runs, b)
    if crossing is None:
        return None
    share, ran = crossing
    return (f"less certain: at batch {b}, {share:.0%} of the transient peak is allocations of 32 MiB and up, which "
            f"glibc maps on their own and unmaps when freed, against at most {ran:.0%} in the runs fitted "
            f"(batch sizes {', '.join(map(str, sorted({x for x, _, _ in runs})))}); the resident set is extrapolated "
            "across glibc's mmap threshold, where errors of -10% to +35% were measured on this project's VM "
            "(BENCHMARKS.md)")


def with_measured_peaks(req: EstimateRequest, bm: BatchModel, first: Calibration | None,
                        points: tuple[Run, ...]) -> Calibration:
    """The resident-set fit again with measured peaks (batch size, resident-set increase in bytes,
    DESIGN.md's CPU protocol; the glibc mmap threshold the run fixed, None for a trial) as more runs beside `first`'s, each weighing like one of them: a trial's
    resident set is one run, as noisy as any (identical runs here differ by up to ~10%). Without a
    first calibration the points are the only runs: one fixes the intercept under the uncalibrated
    default's slope, more draw the slope toward it as their span allows (`_fit`). No run is made here."""
    ratio = first.hidden_ratio if first is not None else 0.0
    rss = (first.rss if first is not None else ()) + tuple(points)
    prior = SLOPE_PRIOR_MEAN if first is not None else CPU_DEFAULT.slope
    return Calibration(**_fit_resident(req, bm, ratio, rss, prior)._asdict(), hidden_ratio=ratio,
                       batches=tuple(sorted({b for b, _, _ in rss})),
                       used_real_traces=first.used_real_traces if first is not None else False, rss=rss,
                       replayed=first.replayed if first is not None else ())


def from_an_eighth(runs: tuple[Run, ...] | list[Run], batch: int) -> tuple[Run, ...]:
    """The runs from an eighth of `batch` up: those a resident-set fit for `batch` takes in beside
    runs nearer it (farther down, the heap reuses freed chunks otherwise; see recalibrate_near)."""
    return tuple(p for p in runs if p[0] >= batch // 8)


def recalibrate_near(spec: str, args: dict[str, Any], req: EstimateRequest, bm: BatchModel, first: Calibration,
                     batch: int) -> Calibration | None:
    """A second round of resident-set runs at `batch` (a predicted largest batch far from the first
    round's) and half of it, fitted together with the first round's runs from an eighth of `batch`
    up: the fit then brackets the batch sizes it is asked about instead of extrapolating from small
    ones, whose resident set follows other rules (glibc serves tensors under 32 MiB from its heap,
    which keeps freed memory; larger ones are mapped and unmapped on their own). The batch model
    (traces) stays: tensor sizes extrapolate exactly; the resident set is what does not. `batch`
    runs twice, with glibc's default allocator (they are measured peaks as a user would see them),
    and half of it with the mmap threshold halved where `batch` lies across it from there
    (`run_mmap_threshold`, `crosses`): how far two identical runs differ there is part of the fit's
    spread, which the largest batch keeps clear of the cap. None when the first round already ran
    at `batch`."""
    if batch in first.batches:
        return None
    runs = [("rss", b, i) for b in sorted({max(1, batch // 2), batch} - set(first.batches)) for i in range(1 + (b == batch))]
    res = _run_parallel(_rss_jobs(spec, args, req, runs, threshold_target(req, bm, (max(1, batch // 2),), batch)))
    rss = from_an_eighth(first.rss, batch) + tuple(_rss_point(res[r]) for r in runs)
    return Calibration(**_fit_resident(req, bm, first.hidden_ratio, rss)._asdict(), hidden_ratio=first.hidden_ratio,
                       batches=tuple(sorted({b for b, _, _ in rss})), used_real_traces=first.used_real_traces, rss=rss,
                       replayed=first.replayed)

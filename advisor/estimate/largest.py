"""The largest batch that fits, per strategy, and its checks where the batch model alone is not trusted.

The batch model (batchmodel.py) takes each allocation as affine in the batch size, which holds for
tensors but not for two things, so the request's own strategy is searched again:
- on this CPU, the resident set (glibc keeps freed heap memory, and maps large allocations on their
  own): real runs near the answer re-fit it (`_max_batch_near`, resident.calibrate.recalibrate_near);
- kernel workspaces sized on this machine's GPU: cuDNN picks a convolution algorithm by shape, and
  its workspace with it, so a workspace measured at batch 32 and 64 says nothing of batch 220
  (resnet18 fp32 on an H100 under a 6.4 GB cap: the model through 32 and 64 answered 220, whose real
  reserved peak is 7.5 GB; the real largest batch is 162-173). So is the scratch a 16-bit matrix product
  holds inside oneDNN on a CPU with AMX (scratch_cpu.is_half_product), where no calibration's real runs take it
  in: without it, tiny-bert bf16's largest batch comes out 146 asked at batch 2 and 149 at 16. The
  answer is searched again on exact traces (`max_batch_on_traces`): bisection between the largest traced
  batch that fits and the smallest that does not, each guess the model's answer through the two traces
  nearest the last one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import numpy as np

from advisor.config import Strategy
from advisor.estimate.batchmodel import BatchModel
from advisor.estimate.evaluator import MAX_BATCH_LIMIT, Evaluator
from advisor.estimate.refine import CAUTION, cautious
from advisor.estimate.resident.calibration import Calibration, Run
from advisor.estimate.resident.fit import SLOPE_PRIOR_MEAN, SLOPE_PRIOR_SD
from advisor.estimate.stages import report
from advisor.estimate.trace import Trace
from advisor.hardware.spec import HardwareSpec
from advisor.workload import Workload

# A second calibration round at the predicted largest batch (twice) and half of it runs only when the
# predicted resident set at the largest is at most resident.calibrate.HOST_SHARE of this host's memory:
# asked about this host's own memory, the largest batch takes about all of it, so the common `estimate`
# on the local CPU never pays for the round. Another round runs where the re-solved answer moved more
# than NEAR away from the batch the round ran at, up to NEAR_ROUNDS rounds in all.
NEAR, NEAR_ROUNDS = 0.1, 3
# Resident bytes per transient live byte that a sample past a real run adds at most, where its runs
# vouch for a larger batch than the fit (`_vouched_by_runs`): one SD over the calibrations' prior
# slope (1.5; fit.SLOPE_PRIOR_MEAN), or the calibration's own where steeper.
RUN_STEP_SLOPE = SLOPE_PRIOR_MEAN + SLOPE_PRIOR_SD
# ... and never this many times past the largest batch already run. The host-share bound above
# trusts the batch model being checked; this one does not: a model that wrongly barely grows would
# send a real run to a batch that takes the host's memory.
NEAR_REACH = 64
# Exact traces at most (each sizes the new shapes' workspaces on the GPU, about a second for a ResNet, or
# probes the new product shapes on this CPU)
EXACT_TRACES = 8


def max_batch_on_traces(fits_on: Callable[[BatchModel, int], bool], solve: Callable[[BatchModel], int],
                        bm: BatchModel, trace_at: Callable[[int], Trace], first: int) -> tuple[int, list[int]]:
    """(largest batch that an exact trace says fits, the batch sizes traced for it). `fits_on(model, b)`:
    whether batch b fits under `model`; `solve(model)`: the model's largest batch; `first`: the answer
    of `bm`, the model the estimate began with."""
    traced: dict[int, Trace] = {bm.a: bm.trace_a}
    if bm.c is not None and bm.trace_c is not None:
        traced[bm.c] = bm.trace_c
    lo, hi = 0, None  # the largest batch that fits, the smallest that does not, on exact traces
    for b, tr in traced.items():
        if fits_on(BatchModel(a=b, trace_a=tr), b):
            lo = max(lo, b)
        else:
            hi = b if hi is None else min(hi, b)
    guess, checked = first, []
    for _ in range(EXACT_TRACES):
        if hi is not None and guess >= hi:
            guess = (lo + hi) // 2
        if guess <= lo or guess < 1:
            break
        if guess not in traced:
            traced[guess] = trace_at(guess)
            checked.append(guess)
        if fits_on(BatchModel(a=guess, trace_a=traced[guess]), guess):
            lo = guess
        else:
            hi = guess
        if hi is not None and hi - lo <= 1:
            break
        near = sorted(traced, key=lambda b: abs(b - guess))[:2]
        guess = solve(BatchModel(a=near[0], trace_a=traced[near[0]], c=near[1], trace_c=traced[near[1]]))
    return lo, checked


def strategies(hw: HardwareSpec) -> list[Strategy]:
    return [Strategy.single] if hw.world_size == 1 else list(Strategy)


def max_batch_traced(ev: Evaluator, trace_at: Callable[..., Trace], first: int, usable: int, notes: list[str],
                     why: str) -> int:
    """The request's largest batch searched again on exact traces (`trace_at(b, flops)`): kernel scratch sized
    by running the op's shapes is not affine in the batch (see the module's docstring); `why`: what was
    sized at each, for the note."""

    def fits_on(bm: BatchModel, b: int) -> bool:
        return Evaluator(ev.hw, ev.req, bm, ev.calib).device_bytes(b) <= usable

    def solve(bm: BatchModel) -> int:
        return Evaluator(ev.hw, ev.req, bm, ev.calib).max_batch(usable)

    answer, traced = max_batch_on_traces(fits_on, solve, ev.bm, lambda b: trace_at(b, False), first)
    if answer != first or traced:
        notes.append(f"largest batch {first} -> {answer}: searched again on traces at batch sizes "
                     f"{', '.join(map(str, traced)) or 'already traced'}, {why}")
    return answer


def largest_batches(ev: Evaluator, calibrated: bool, points: list[Run], workload: Workload | str | None,
                    workload_args: dict[str, Any] | None, usable: int, notes: list[str],
                    record: Callable[[tuple[Run, ...]], None] | None = None,
                    trace_at: Callable[..., Trace] | None = None, why: str = "") -> dict[str, int]:
    """The largest batch per strategy. The request's own, on this CPU: re-solved after real runs near
    it when calibrated and `workload` is a name (the new runs go to `record`; None: no real runs); with
    measured peaks and no calibration runs, also
    solved with the fit's slope a few posterior SDs steeper (refine.cautious), the smaller answer kept.
    With `trace_at(b, flops)` (kernel scratch sized at each shape, `why`): searched again on exact traces."""
    by_strategy = {s.value: ev.max_batch(usable, s) for s in strategies(ev.hw)}
    own = ev.req.strategy.value
    if trace_at is not None and ev.refined is None:
        by_strategy[own] = max_batch_traced(ev, trace_at, by_strategy[own], usable, notes, why)
    elif calibrated and ev.refined is None:
        again = _max_batch_near(ev, workload, workload_args, by_strategy[own], usable, notes, record)
        by_strategy[own] = by_strategy[own] if again is None else again
    elif points and ev.hw.device_type == "cpu" and ev.calib is not None:
        steep = cautious(ev.calib, [ev.transient(b, t) for b, _, t in points], [p for _, p, _ in points])
        answer = Evaluator(ev.hw, ev.req, ev.bm, steep).max_batch(usable)
        if answer < by_strategy[own]:
            notes.append(f"largest batch {by_strategy[own]} -> {answer}: solved again with the resident-set slope "
                         f"{CAUTION:.0f} posterior SDs steeper ({steep.slope:.2f}), as the measured points alone say "
                         "little about it far from them")
            by_strategy[own] = answer
    capped = [s for s, b in by_strategy.items() if b >= MAX_BATCH_LIMIT]
    if capped:
        notes.append(f"largest batch: at least {MAX_BATCH_LIMIT} ({', '.join(capped)}), the search's limit; "
                     "a larger batch may fit too")
    return by_strategy


def _max_batch_near(ev: Evaluator, workload: Workload | str | None, workload_args: dict[str, Any] | None, first: int,
                    usable: int, notes: list[str],
                    record: Callable[[tuple[Run, ...]], None] | None = None) -> int | None:
    """The largest batch re-solved after real runs at the first answer and half of it (CPU,
    calibrated), when those runs are cheap; again from the new answer while it lands more than
    NEAR away from where the runs were (the fit then extrapolated), or below them where they measured
    over the cap, or at the batch the runs vouch for (`_next_round`), at most NEAR_ROUNDS times. The
    answer stays below any batch whose runs measured over (`_measured_over`), and runs that measured
    clear may vouch for a little more (`_vouched_by_runs`). None when no second round ran (see
    resident/calibrate.py)."""
    from advisor.errors import TrialError
    from advisor.estimate.resident.calibrate import HOST_SHARE, host_memory_bytes, recalibrate_near

    host = host_memory_bytes()
    answer, again = first, None
    for _ in range(NEAR_ROUNDS):
        if not isinstance(ev.calib, Calibration) or not isinstance(workload, str) or answer < 2:
            break
        if ev.predicted_total(answer) > HOST_SHARE * host:
            break
        if answer > NEAR_REACH * max(ev.calib.batches):
            notes.append(f"largest batch {answer} not checked with real runs: over {NEAR_REACH}x the largest batch run "
                         f"({max(ev.calib.batches)}), too far to trust what a run there would cost")
            break
        report(f"largest batch: real steps at {answer} (twice) and {max(1, answer // 2)} to check it")
        try:
            calib = recalibrate_near(workload, workload_args or {}, ev.req, ev.bm, ev.calib, answer)
        except TrialError as exc:  # a run there failed (out of memory, say): the answer so far stands
            notes.append(f"largest batch {answer} not re-solved: a real run near it failed: {exc}")
            break
        if calib is None:
            break
        if record is not None:
            ran = set(ev.calib.rss)
            record(tuple(r for r in calib.rss if r not in ran))
        ev = Evaluator(ev.hw, ev.req, ev.bm, calib)
        ran_at, again = answer, ev.max_batch(usable)
        notes.append(f"largest batch re-solved after real runs at {ran_at} (fit over batch sizes "
                     f"{', '.join(map(str, calib.batches))}: {calib.formula()}, "
                     f"runs within {calib.spread / 2**20:.0f} MiB of it, "
                     f"{calib.margin(ev.predicted_total(max(again, 1))) / 2**20:.0f} MiB kept clear): "
                     f"{ran_at} -> {again}")
        answer = _next_round(ev, usable, ran_at, again)
        if answer is None:
            break
    if again is not None:
        over = _measured_over(ev, usable)
        if over is not None and again >= over:
            notes.append(f"largest batch {again} -> {over - 1}: real runs at {over} measured over the cap "
                         "(their median)")
            again = over - 1
        again = _vouched_by_runs(ev, usable, again, notes) or again
    return again


def _next_round(ev: Evaluator, usable: int, ran_at: int, fitted: int) -> int | None:
    """Where the next near round runs after one at `ran_at` whose fit answered `fitted`, or None to
    stop: at `fitted` where it lies more than NEAR from `ran_at` (the fit extrapolated), or below runs
    that measured over the cap (only the fit says the gap between fits); else at the batch the runs
    vouch for past `fitted` (`_vouched_by_runs`) where it lies past every batch run so far, so that a
    vouched-for answer is checked by runs of its own while rounds remain (runs at a batch vouch for a
    sample or so past it, and runs there for one more). Not just under a larger batch whose runs did not
    vouch for themselves: runs there would not either."""
    over = _measured_over(ev, usable)
    if abs(fitted - ran_at) > NEAR * ran_at or (fitted < ran_at and over is not None and over <= ran_at):
        return fitted
    vouched = _vouched_by_runs(ev, usable, fitted, [], explore=True)
    return vouched if vouched is not None and vouched > max(_default_runs(ev), default=0) else None


def _default_runs(ev: Evaluator) -> dict[int, list[int]]:
    """The calibration's resident-set runs under glibc's default allocator, as the user's run will be,
    by batch size (bytes); empty without a calibration from runs."""
    return ev.calib.default_runs() if isinstance(ev.calib, Calibration) else {}


def _run_limit(ev: Evaluator, usable: int) -> int:
    """What a resident-set run may measure under `usable` (bytes): the runs measure the resident set,
    not the runtime beside it."""
    return usable - ev.total(1)[1]


def _measured_over(ev: Evaluator, usable: int) -> int | None:
    """The smallest batch whose real runs under glibc's default measured over `usable` (their median;
    the runtime beside the resident set taken off), or None. No answer may reach it: near the cap
    identical runs differ by up to 10% (resnet18 at 64 px: 1398, 1398 and 1534 MB at batch 402), and a
    fit through runs on both sides can still place its answer above runs that did not fit."""
    limit = _run_limit(ev, usable)
    over = [b for b, rs in _default_runs(ev).items() if float(np.median(rs)) > limit]
    return min(over) if over else None


def _vouched_by_runs(ev: Evaluator, usable: int, fitted: int, notes: list[str], explore: bool = False) -> int | None:
    """The largest batch that the real runs near the answer vouch for (CPU, calibrated), where it is larger
    than the fit's answer `fitted`, else None. The fit is one line through runs that may straddle a bend
    (gpt2-small at seq 64: the live peak moves from the optimizer step to the backward near batch 11, the
    resident set's near 15), and keeps its whole spread clear, so it can answer below a batch whose runs
    measured well under the cap. A batch is vouched for by its own runs under glibc's default where the
    highest stays within the cap less `Calibration.runs_share` of it, and no smaller batch's runs measured
    over; from the largest such b0 whose runs also keep `noise_share` clear, up to NEAR x b0 further while
    b0's worst run plus the steepest per-sample growth (at RUN_STEP_SLOPE) stays within it too, never up to
    a larger batch whose runs measured over. `explore` (`_next_round`): past b0 with only `runs_share`
    kept, since that batch then gets runs of its own."""
    by_batch = _default_runs(ev)
    if not by_batch:  # no runs (and then no Calibration to take their noise from)
        return None
    limit = _run_limit(ev, usable)
    over = _measured_over(ev, usable)

    def room(rs: list[int], share: float) -> float:  # under the limit, the worst run and its noise kept clear (bytes)
        return limit - (1 + share) * max(rs)

    def own_share(rs: list[int]) -> float:  # what a batch's own runs keep clear above the highest of them (share)
        return ev.calib.runs_share(len(rs), max(rs))

    own = [b for b, rs in by_batch.items() if room(rs, own_share(rs)) >= 0 and (over is None or b < over)]
    lo, why = None, ""
    if own:
        rs = by_batch[max(own)]
        lo, why = max(own), (f"its own {len(rs)} real run(s) ({max(rs) / 2**20:.0f} MiB at most, within the cap less "
                             f"{own_share(rs):.1%} of it, what the median of later runs may add)")

    def kept_past(rs: list[int]) -> float:  # what extending past a batch's runs keeps clear above them (share)
        return own_share(rs) if explore else ev.calib.noise_share(max(rs))

    clear = [b for b in own if room(by_batch[b], kept_past(by_batch[b])) >= 0]
    if clear:
        b0 = max(clear)
        top = min([b0 + max(1, int(NEAR * b0))] + [b - 1 for b in by_batch if b > b0])
        steep = Evaluator(ev.hw, ev.req, ev.bm, replace(ev.calib, slope=max(ev.calib.slope, RUN_STEP_SLOPE)))
        at_b0, left = steep.predicted_total(b0), room(by_batch[b0], kept_past(by_batch[b0]))

        def grows(b: int) -> float:  # at most, from b0 to b (bytes)
            total = steep.predicted_total(b)
            return (b - b0) * max(total - steep.predicted_total(b - 1), (total - at_b0) / (b - b0))

        past, hi = b0, top + 1  # past is vouched for; hi is not
        while hi - past > 1:
            mid = (past + hi) // 2
            past, hi = (mid, hi) if grows(mid) <= left else (past, mid)
        if lo is None or past > lo:
            lo, why = past, (f"the real runs at {b0} ({max(by_batch[b0]) / 2**20:.0f} MiB at most, "
                             f"{left / 2**20:.0f} MiB clear of the cap less their noise), each sample past them "
                             f"taken at {steep.calib.slope:.2f} resident bytes per transient byte at most")
    if lo is None or lo <= fitted:
        return None
    notes.append(f"largest batch {fitted} -> {lo}: vouched for by {why} (the fit through all the runs keeps its "
                 "whole spread clear)")
    return lo

"""A CPU trial's memory as the estimator predicts it: one run of docs/design.md's peak protocol in a fresh
process after the trial, kept as a measured peak (advisor/peaks.py) that refines later estimates of the
same workload, host and memory knobs (the tuner's pruning, the next trial's prediction, the largest batch).

The trial's own peak cannot serve (probes/runner.py `_record_peak`). The run here is the protocol itself
(advisor.measure, mode rss) at the trial's batch and memory knobs, on the workload's make_batch. It starts
after the trial's processes are gone, so it takes no core from the measurement; its seconds count in the
trial's wall time and overhead. Only what the protocol reproduces is kept: the CPU, one process, eager.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from advisor.errors import AdvisorError
from advisor.hardware.spec import HardwareSpec
from advisor.trial import CompileMode, TrainingConfig, TrialBudget, TrialResult
from advisor.workload import WorkloadInfo

log = logging.getLogger(__name__)
# 'auto' skips trials that use less than this share of their memory: there an error of the estimate
# decides nothing soon (the tuner's batch sizes grow by factors of 2; a peak of 1/8 is 3 doublings away).
AUTO_SHARE = 1 / 8
# 'auto' skips a batch within this factor of one already measured by the protocol: the resident-set
# fit interpolates between such points within their noise.
NEAR = 2.0
# Less than this left of the trial's timeout: no run (a fresh process imports torch first).
MIN_TIMEOUT_S = 10.0


def _why_not(budget: TrialBudget, config: TrainingConfig, hw: HardwareSpec, result: TrialResult) -> str | None:
    """Why this trial gets no protocol run ('' : silently none), or None: run it (subject to the store)."""
    if budget.record_peak == "never" or config.device != "cpu" or not result.ok:
        return ""
    cannot = None
    if config.nproc != 1:
        cannot = f"the protocol runs one process; this trial ran {config.nproc}"
    elif config.compile_mode != CompileMode.none:
        cannot = f"the protocol runs eager steps; this trial compiled ({config.compile_mode.value})"
    if cannot:
        return "" if budget.record_peak == "auto" else f"no fresh-process peak run: {cannot}"
    limit = budget.memory_cap_bytes or hw.memory_per_device_bytes
    # A forked rank's growth moves with the fork server's heap, the prediction does not: the larger counts.
    used = max(result.peak_memory_bytes or 0, result.predicted_memory_bytes or 0)
    if budget.record_peak == "auto" and used < AUTO_SHARE * limit:
        return ""
    return None


def record_protocol_peak(workload: str, workload_args: dict[str, Any], wl: WorkloadInfo, hw: HardwareSpec,
                         config: TrainingConfig, budget: TrialBudget, result: TrialResult,
                         deadline: float) -> TrialResult:
    """`result` with the protocol's peak and a note where a run was made (or asked for and not made);
    `result` itself otherwise. Nothing here fails the trial: a run that cannot be made or kept is a note."""
    why = _why_not(budget, config, hw, result)
    if why is not None:
        return _with_note(result, why) if why else result
    from advisor.measure import MeasureRequest, measure
    from advisor.peaks import default_peaks, record_points, request_key
    from advisor.render import human_bytes
    from advisor.trial import estimate_request, trial_hardware

    one = trial_hardware(hw, config)  # nproc is 1 here
    b = config.batch_size
    request = estimate_request(config)
    try:
        fingerprint = wl.fingerprint
        store = default_peaks()
        if budget.record_peak == "auto":  # a calibration's runs count too: they are the same protocol
            if any(p.batch_size / NEAR <= b <= p.batch_size * NEAR
                   for p in store.points(request_key(fingerprint, one, request, "none", "cpu_rss"))):
                return result
        left = deadline - time.monotonic()
        if left < MIN_TIMEOUT_S:
            return _with_note(result, f"no fresh-process peak run: {left:.0f} s left of the trial's timeout")
        started = time.monotonic()
        # not held to the trial's memory cap: it runs what just fit under it
        run = measure(MeasureRequest(workload=workload, workload_args=workload_args, batch_size=b,
                                     precision=config.precision, optimizer=config.optimizer,
                                     optimizer_impl=config.optimizer_impl, checkpointing=config.checkpointing,
                                     fused_backward=config.fused_backward, threads=config.threads, mode="rss"),
                      timeout_s=left)
        peak = int(run.rss_delta_bytes)
        predicted = result.predicted_memory_bytes
        record_points(fingerprint, one, request, "none", "cpu_rss", [(b, peak, predicted, None)], store)
    except AdvisorError as exc:  # the trial stands; later estimates go without this refinement
        log.warning("fresh-process peak not recorded: %s", exc)
        return _with_note(result, f"no fresh-process peak kept: {exc}")
    except Exception as exc:  # noqa: BLE001 - a bug here must not lose the trial's measurement; it is reported
        log.exception("fresh-process peak run failed")
        return _with_note(result, f"no fresh-process peak kept: {type(exc).__name__}: {exc}")
    vs = f" (predicted {human_bytes(predicted)}, {(predicted - peak) / peak:+.1%})" if predicted and peak else ""
    note = (f"docs/design.md's peak protocol, run once in a fresh process after the trial: {human_bytes(peak)} at "
            f"batch {b}{vs}; kept as a measured peak, so later estimates of this configuration are refined by it")
    spent = time.monotonic() - started
    return _with_note(result.model_copy(update={"protocol_peak_bytes": peak, "wall_s": result.wall_s + spent,
                                                 "overhead_s": (result.overhead_s or 0.0) + spent}), note)


def _with_note(result: TrialResult, note: str) -> TrialResult:
    return result.model_copy(update={"notes": [*result.notes, note]})

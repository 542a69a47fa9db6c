"""`run_trial`: one TrainingConfig measured in fresh processes, one per rank, with a hard timeout.

The ranks run in a process group of their own (DataLoader workers included), so a timeout, a
memory cap or a crash of any rank kills every process of the trial and nothing is left behind.
Whatever happens, the caller gets a TrialResult; only a user's bad input (an unknown preset, a
workload file that does not import) raises, before anything is launched. The workload is loaded and
estimated in an isolated worker (advisor/isolation), never in the caller's process: one that crashes,
hangs or outgrows its memory there is the trial's result too.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from advisor import isolation
from advisor.errors import AdvisorError, SpecError, WorkloadFailed, invalid_input
from advisor.hardware import get_hardware
from advisor.hardware.spec import HardwareSpec
from advisor.isolation.forkserver import kill_groups, reap
from advisor.procmem import group_pss
from advisor.trial import (
    RANK_FAILURE_GRACE_S,
    CompileMode,
    RankFigures,
    TrainingConfig,
    TrialBudget,
    TrialResult,
    TrialStatus,
    inapplicable,
    trial_hardware,
)
from advisor.workload import WorkloadInfo
from probes.child import ChildReport, ChildRequest
from probes.summary import summarize

log = logging.getLogger(__name__)
POLL_S = 0.05  # how often the parent looks at its ranks (s)
MEMORY_POLL_S = 0.2  # how often it sums their memory against the cap (s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(request_path: Path, config: TrainingConfig, workdir: Path) -> list[Any]:
    """Start every rank; each leads its own session and process group (see probes.child.entry)."""
    from probes.forkserver import ENTRY, get_server

    env = dict(os.environ, WORLD_SIZE=str(config.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               LOCAL_WORLD_SIZE=str(config.nproc), PYTHONUNBUFFERED="1")
    if config.nproc > 1 and config.device == "cpu" and config.threads is None:
        # N ranks on one CPU: torch's default (all cores each) oversubscribes; split the cores instead.
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // config.nproc))
    server = get_server()
    procs = []
    for rank in range(config.nproc):
        env_r = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        procs.append(server.spawn(ENTRY, [str(request_path), str(workdir / f"rank{rank}.log")], env_r))
    return procs


def _watch(procs: list[Any], budget: TrialBudget, started: float) -> tuple[str, int]:
    """Wait for the ranks; returns ('done' | 'timeout' | 'oom', peak group memory seen in bytes)."""
    peak = 0
    next_mem = 0.0
    failed_at: float | None = None
    while True:
        codes = [p.exitcode for p in procs]
        if all(c is not None for c in codes):
            return "done", peak
        now = time.monotonic()
        if any(c not in (None, 0) for c in codes):
            failed_at = failed_at or now
            if now - failed_at > RANK_FAILURE_GRACE_S:  # the others wait in a collective forever
                kill_groups(procs)
        if now - started > budget.timeout_s:
            kill_groups(procs)
            return "timeout", peak
        if budget.memory_cap_bytes and now >= next_mem:
            next_mem = now + MEMORY_POLL_S
            peak = max(peak, sum(group_pss(p.pid) for p in procs))
            if peak > budget.memory_cap_bytes:
                kill_groups(procs)
                return "oom", peak
        time.sleep(POLL_S)


def _read_reports(workdir: Path, nproc: int) -> list[ChildReport | None]:
    out: list[ChildReport | None] = []
    for rank in range(nproc):
        path = workdir / f"rank{rank}.json"
        out.append(ChildReport.model_validate_json(path.read_text()) if path.exists() else None)
    return out


def _log_tail(workdir: Path, rank: int, lines: int = 12) -> str:
    path = workdir / f"rank{rank}.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _failure_status(outcome: str, procs: list[Any], reports: list[ChildReport | None],
                    workdir: Path, budget: TrialBudget, peak_mem: int) -> tuple[TrialStatus, str] | None:
    """The status and message when the trial did not measure; None when every rank reported ok."""
    if outcome == "timeout":
        return TrialStatus.timeout, f"no result within {budget.timeout_s:g} s; the trial's process group was killed"
    if outcome == "oom":
        return TrialStatus.oom, (f"the trial's processes reached {peak_mem / 2**20:.0f} MiB, past the memory cap of "
                                 f"{budget.memory_cap_bytes / 2**20:.0f} MiB; killed")
    for rank, (proc, rep) in enumerate(zip(procs, reports)):
        if rep is not None and rep.status != TrialStatus.ok:
            return rep.status, (f"rank {rank}: " if len(procs) > 1 else "") + (rep.error or rep.status.value)
    for rank, proc in enumerate(procs):
        code = proc.exitcode
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            return TrialStatus.crashed, f"rank {rank} was killed by {name}\n{_log_tail(workdir, rank)}".rstrip()
        if reports[rank] is None:
            tail = _log_tail(workdir, rank)
            return TrialStatus.error, f"rank {rank} exited with code {code} and no report\n{tail}".rstrip()
    return None


def _estimate(workload: str, wargs: dict[str, Any], config: TrainingConfig, hw: HardwareSpec,
              timeout_s: float | None = None, memory_cap_bytes: int | None = None) -> tuple[Any, str | None]:
    """The estimator's prediction for this config (no calibration runs), or why there is none.

    Computed before the ranks start, not beside them: a trace running next to the measurement
    would take a core from it. It runs in an isolated worker (advisor/isolation): a workload that
    crashes or hangs there costs the trial its prediction, and the ranks then measure what it does.
    """
    from advisor.estimate import EstimateOptions, EstimateRequest

    hw = trial_hardware(hw, config)

    def made() -> Any:
        request = EstimateRequest.of(config.batch_size, precision=config.precision, optimizer=config.optimizer,
                                     strategy=config.strategy, checkpointing=config.checkpointing,
                                     fused_backward=config.fused_backward, optimizer_impl=config.optimizer_impl)
        options = EstimateOptions(calibrate=False, compile_mode=config.compile_mode.value, largest=False)
        return isolation.estimate(workload, hw, request, options, workload_args=wargs, timeout_s=timeout_s,
                                  memory_cap_bytes=memory_cap_bytes, reuse=True)

    return _or_why("estimate", made)


def _estimate_ranks(workload: str, wargs: dict[str, Any], config: TrainingConfig, hw: HardwareSpec,
                    timeout_s: float | None = None, memory_cap_bytes: int | None = None) -> tuple[Any, str | None]:
    """The per-rank estimate (advisor.estimate.parallel's LayoutEstimate) of a tp/pp config on the trial's devices,
    made in an isolated worker before the ranks start, as `_estimate` makes its; or None and why there is none."""
    from advisor.trial import estimate_request

    return _or_why("per-rank estimate", lambda: isolation.estimate_layout(
        workload, trial_hardware(hw, config), config.layout(), estimate_request(config), workload_args=wargs,
        grad_accum=config.grad_accum, timeout_s=timeout_s, memory_cap_bytes=memory_cap_bytes))


def _or_why(what: str, make: Any) -> tuple[Any, str | None]:
    """(make(), None), or (None, "no <what>: why") where it fails: no estimate never loses a measurement."""
    try:
        return make(), None
    except AdvisorError as exc:
        return None, f"no {what}: {exc}"
    except Exception as exc:  # noqa: BLE001 - an estimator bug must not lose a measurement; it is reported
        log.exception("%s failed", what)
        return None, f"no {what}: {type(exc).__name__}: {exc}"


def rank_figures(reports: list[ChildReport | None], estimate: Any) -> list[RankFigures]:
    """Each rank's measured figures beside what `estimate` (a LayoutEstimate, or None) predicted for it."""
    out = []
    for rep in reports:
        assert rep is not None and rep.peak is not None  # the caller checked every rank reported ok
        pred = estimate.for_rank(rep.rank) if estimate is not None else None
        out.append(RankFigures(rank=rep.rank, coords=rep.coords or {}, peak=rep.peak, comm_bytes=rep.comm_bytes or {},
                               predicted_allocated_bytes=pred.allocated_bytes if pred is not None else None,
                               predicted_total_bytes=pred.total_bytes if pred is not None else None,
                               predicted_comm_bytes=dict(pred.comm_bytes) if pred is not None else None))
    return out


def _cpu_busy(interval_s: float = 0.25) -> float:
    """Share of this machine's CPU time spent busy over `interval_s` (from /proc/stat)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, total

    idle0, total0 = sample()
    time.sleep(interval_s)
    idle1, total1 = sample()
    return 1.0 - (idle1 - idle0) / max(total1 - total0, 1)


def _settle(budget: TrialBudget) -> tuple[str | None, float | None]:
    """Wait (up to budget.settle_s) for the machine to go quiet, so others' work does not slow the
    measurement: (a note when it never did, the share of the CPUs busy at the last look; None: not looked).
    Busy is no small error: a thread that loses its core holds up the others at every parallel region
    (evidence: bench/tune_load.py, bench/results/tune-load.md)."""
    if budget.settle_s <= 0:
        return None, None
    deadline = time.monotonic() + budget.settle_s
    busy = _cpu_busy()
    while busy > budget.quiet_cpu_fraction and time.monotonic() < deadline:
        busy = _cpu_busy()
    if busy > budget.quiet_cpu_fraction:
        cpus = os.cpu_count() or 1
        return (f"the machine was {busy:.0%} busy with other work ({busy * cpus:.1f} of its {cpus} CPUs) when the "
                f"trial started, after waiting {budget.settle_s:g} s for quiet: its figures may be several times low "
                "(one busy loop beside a two-thread trial cut its throughput tenfold in bench/tune_load.py)"), busy
    return None, busy


def config_from_dict(values: dict[str, Any], *, device: str) -> TrainingConfig:
    """A TrainingConfig from user-given knobs; SpecError naming what was wrong and what is allowed."""
    from pydantic import ValidationError

    values = {k.replace("-", "_"): v for k, v in values.items()}
    unknown = sorted(set(values) - set(TrainingConfig.model_fields))
    if unknown:
        raise SpecError(f"unknown knob(s) {', '.join(unknown)}; known: {', '.join(TrainingConfig.model_fields)}")
    try:
        return TrainingConfig(**{"device": device, **values})
    except ValidationError as exc:
        raise invalid_input(exc) from exc


def run_trial(workload: str, config: TrainingConfig | dict, *, hardware: HardwareSpec | str = "local",
              workload_args: dict[str, Any] | None = None, budget: TrialBudget | None = None,
              estimate: bool = True, count_ops: bool = True, prediction: Any = None) -> TrialResult:
    """Measure `config` for real; see the module docstring. `workload` is a preset or file.py:build. `prediction`:
    the estimate the caller made of this config on this hardware (the tuner's, which decided to launch it; a
    MemoryEstimate, or a LayoutEstimate for tp/pp), recorded instead of estimating again."""
    t0 = time.monotonic()
    wargs = dict(workload_args or {})
    budget = budget or TrialBudget()
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    if isinstance(config, dict):
        config = config_from_dict(config, device=hw.device_type)
    from advisor.finetune import with_rank

    wargs = with_rank(wargs, config.lora_r)  # the knob's rank builds the adapters, here and in every rank
    try:  # in an isolated worker, within the trial's timeout and memory cap; bad input raises here
        wl = isolation.describe(workload, wargs, timeout_s=budget.timeout_s, memory_cap_bytes=budget.memory_cap_bytes)
    except WorkloadFailed as exc:  # crashed, hung or outgrew its cap while loading: the trial's result
        return TrialResult(status=TrialStatus(exc.status), error=f"{exc}\n{exc.detail}".rstrip(), workload=workload,
                           hardware=_hardware_name(hw, config), config=config, wall_s=time.monotonic() - t0)
    base = dict(workload=wl.name, hardware=_hardware_name(hw, config), config=config)
    reason = inapplicable(config, hw, wl)
    layout = config.layout()
    if reason is None and layout.dp > 1:
        from probes.parallel import check_strategy

        reason = check_strategy(config.strategy, layout.dp if layout.parallel else config.nproc, config.device,
                                fused_backward=config.fused_backward, optimizer_kind=config.optimizer,
                                impl=config.optimizer_impl)
    if reason:
        return TrialResult(status=TrialStatus.invalid, error=reason, wall_s=time.monotonic() - t0, **base)
    from advisor.settings import get_settings

    data_dir = get_settings().data_dir
    (data_dir / "trials").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=data_dir / "trials", prefix="trial-") as tmp:
        workdir = Path(tmp)
        compiled = config.compile_mode != CompileMode.none
        req = ChildRequest(workload=workload, workload_args=wargs, config=config, budget=budget,
                           result_dir=str(workdir), count_ops=count_ops,
                           inductor_cache_dir=str(data_dir / "inductor") if compiled else None)
        request_path = workdir / "request.json"
        request_path.write_text(req.model_dump_json())
        from probes.forkserver import get_server

        server = get_server()  # its imports (seconds) start now, beside the estimate, where a second core takes them
        # at most half of what is left of the trial's time: the rest is the measurement's
        left = budget.timeout_s - (time.monotonic() - t0)
        predict = _estimate_ranks if layout.parallel else _estimate
        if prediction is not None:  # the caller's stands: a layout's or a workload file's is never reused (seconds)
            note = None
        else:
            prediction, note = (predict(workload, wargs, config, hw, max(1.0, left / 2), budget.memory_cap_bytes)
                                if estimate else (None, None))
        server.wait_ready()  # before the look for quiet, which would count its imports as others' work
        busy_note, base["others_busy"] = _settle(budget)
        notes = [n for n in (note, busy_note) if n]
        procs = _launch(request_path, config, workdir)
        try:
            outcome, peak_mem = _watch(procs, budget, t0)
        finally:
            reap(procs)
        reports = _read_reports(workdir, config.nproc)
        failure = _failure_status(outcome, procs, reports, workdir, budget, peak_mem)
        for p in procs:
            p.close()
    wall = time.monotonic() - t0
    if failure is not None:
        return TrialResult(status=failure[0], error=failure[1], wall_s=wall, notes=notes, **base)
    if layout.parallel:
        return _parallel_result(reports, prediction, wl, hw, config, wall, base, notes)
    result = summarize(reports, wl, hw, config, prediction, wall, base, notes)
    _record_peak(wl, hw, config, result)
    from probes.protocol import record_protocol_peak

    return record_protocol_peak(workload, wargs, wl, hw, config, budget, result, t0 + budget.timeout_s)


def _parallel_result(reports: list[ChildReport | None], prediction: Any, wl: WorkloadInfo, hw: HardwareSpec,
                     config: TrainingConfig, wall: float, base: dict[str, Any], notes: list[str]) -> TrialResult:
    """A tp/pp trial's result: rank 0's timings (the ranks step in lockstep) and every rank's figures beside the
    layout's per-rank estimate. Its peaks are not kept (`_record_peak`): they describe one rank of a layout, not
    the config as the single-device estimator sees it."""
    if prediction is not None and prediction.predicts == "cpu_allocated":
        logged = all(rep is not None and rep.peak is not None and rep.peak.cpu_allocated_bytes is not None
                     for rep in reports)
        notes = [*notes, "the per-rank estimates are of live tensor bytes: 'allocated' is every thread's, logged "
                 "over the build and two warm-up steps" if logged else "the per-rank estimates are of live tensor "
                 "bytes; without gcc to build the storage logger, a CPU rank's only peak is its resident-set growth"]
    ranks = rank_figures(reports, prediction)
    return summarize(reports, wl, hw, config, None, wall, base, notes).model_copy(update={"ranks": ranks})


def _hardware_name(hw: HardwareSpec, config: TrainingConfig) -> str:
    return f"{hw.accelerator.name}:{config.nproc}" if config.nproc > 1 else hw.accelerator.name


def _record_peak(wl: WorkloadInfo, hw: HardwareSpec, config: TrainingConfig, result: TrialResult) -> None:
    """A measured CUDA peak refines the estimator for this workload and device (advisor/peaks.py).

    CPU peaks are not kept: they differ from docs/design.md's fresh-process peak, which the CPU estimate
    predicts, by more than one run's noise and by no constant. The rank is forked from a server that
    imported torch's compiler stack, which a fresh process imports while building its optimizer, and
    the trial's loop (a DataLoader collating per-sample items, op counting) holds more than the
    protocol's make_batch loop; nor does a protocol run inside the rank stand in, as a fresh process
    imports that stack between its tensors. CPU points come from fresh-process runs instead: a
    calibration's (advisor.measure) and the one a CPU trial makes after itself (probes/protocol.py).
    Evidence: bench/calibration_accuracy.py, bench/results/calibration.md."""
    if config.device != "cuda" or not result.peak_memory_bytes:
        return
    from advisor.peaks import record_measured_peak
    from advisor.trial import estimate_request

    try:
        record_measured_peak(wl, trial_hardware(hw, config), estimate_request(config), config.compile_mode.value,
                             result.peak_memory_bytes, "cuda_reserved", result.predicted_memory_bytes)
    except AdvisorError as exc:  # a peak that cannot be kept costs the estimator a refinement, nothing more
        log.warning("measured peak not recorded: %s", exc)

"""Tune jobs outside the request: `JobWorker` claims queued jobs from the database and runs each in
a process of its own (`python -m api.jobs JOB_ID`), which calls `run_tune` like `advisor tune`.

Slots: one per GPU this machine shows, or one for the CPU (a CPU trial takes the whole machine);
ADVISOR_MAX_JOBS caps them. Cancel stops the job's process group (SIGTERM, then SIGKILL), marks its
running trials interrupted and ends the job `cancelled`. A job process dies with its worker
(PR_SET_PDEATHSIG); jobs a dead worker left running, or that crashed on a transient database error
(up to TRANSIENT_ATTEMPTS), go back to the queue and resume their study when claimed again.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from advisor.errors import AdvisorError, SpecError

if TYPE_CHECKING:
    from advisor.store.records import JobRecord
    from advisor.tune.request import TuneRequest
    from api.schemas import TuneJobRequest

log = logging.getLogger(__name__)
POLL_S = 1.0
STOP_GRACE_S = 10.0  # SIGTERM, then this long before SIGKILL (s)
CPU_SLOT = "cpu"
# Attempts in all (claims) for a job that crashes on a transient database error: each resumes its study.
TRANSIENT_ATTEMPTS = 3


def tune_request(body: dict, *, db: str | None, ray_address: str | None) -> "TuneRequest":
    """The TuneRequest a job runs: the API's TuneJobRequest fields, the service's store and Ray."""
    from advisor.trial import TrialBudget
    from advisor.tune.request import TuneRequest
    from api.schemas import TuneJobRequest

    r = TuneJobRequest.model_validate(body)
    budget = TrialBudget(warmup_steps=2, min_steps=5, min_time_s=r.min_time_s, timeout_s=r.trial_timeout_s,
                         settle_s=r.settle_s)
    return TuneRequest(workload=r.workload, workload_args=r.load_args(), hardware=r.hardware, space=r.space,
                       fixes=r.fixes, objective=r.objective, global_batch_size=r.global_batch_size, sampler=r.sampler,
                       trials=r.trials, time_budget_s=r.time_budget_s, patience=r.patience, seed=r.seed,
                       remeasure=r.remeasure, confirm=r.confirm, db=db, ray_address=ray_address, trial_budget=budget)


def validate_job(body: "TuneJobRequest", *, pool=None, timeout_s: float | None = None) -> None:  # noqa: ANN001
    """What `advisor tune` would refuse, refused at submission (SpecError -> 422): the workload
    builds (in an isolated worker of `pool`, within `timeout_s`), the hardware and space exist, the
    fixes are knobs of the space."""
    from advisor.tune.driver import _prepare

    try:
        req = tune_request(body.model_dump(mode="json"), db=None, ray_address=None)
    except ValueError as exc:
        raise SpecError(str(exc).splitlines()[-1].strip()) from None
    _prepare(req, pool=pool, timeout_s=timeout_s)
    needed, slots = devices_needed(body.hardware), len(device_slots())
    if needed > slots:
        raise SpecError(f"hardware {body.hardware!r} needs {needed} devices; this service's worker has {slots}")


def devices_needed(hardware: str) -> int:
    """Slots a job on `hardware` occupies: its devices per node on a GPU, one on the CPU; one when
    the jobs run on a Ray cluster (Ray places their trials on the cluster's devices)."""
    from advisor.hardware import get_hardware
    from advisor.settings import get_settings

    hw = get_hardware(hardware)
    if get_settings().ray_address:
        return 1
    return 1 if hw.device_type == "cpu" else max(1, hw.devices_per_node)


def device_slots() -> list[str]:
    """This machine's GPU indices as CUDA sees them, or ['cpu']; capped by ADVISOR_MAX_JOBS. On a
    Ray cluster (ADVISOR_RAY_ADDRESS): ADVISOR_MAX_JOBS slots (default 1), not this machine's."""
    from advisor.hardware import probe_local
    from advisor.settings import get_settings

    settings = get_settings()
    if settings.ray_address:
        return [f"ray{i}" for i in range(settings.max_jobs or 1)]
    try:
        gpus = [str(g.index) for g in probe_local().gpus]
    except AdvisorError:
        gpus = []
    slots = gpus or [CPU_SLOT]
    return slots[:settings.max_jobs] if settings.max_jobs else slots


# -- the job process ---------------------------------------------------------------------------------
class _Stop(BaseException):
    """SIGTERM in a job process: unwind (Ray shuts down in run_tune's finally), leave the status to the worker."""


def transient(exc: BaseException) -> bool:
    """Whether a database error that may not happen again lies in the exception's chain: an
    OperationalError (DB-API: an error of the database's operation, not of the program: a lock held
    past the busy timeout, a dropped connection), raised as it is or wrapped (Optuna's RDB storage raises
    StorageInternalError from it)."""
    from sqlalchemy.exc import OperationalError

    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, OperationalError):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _what(exc: BaseException) -> str:
    """An exception and the one it was raised from, a line each at most: a library's wrapper (Optuna's
    StorageInternalError) says little without its cause (the database's own error)."""
    def line(e: BaseException) -> str:
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"

    cause = exc.__cause__ or exc.__context__
    return line(exc) + (f", from {line(cause)}" if cause is not None else "")


def run_job(job_id: str, db: str) -> int:
    """Run one claimed job to its end; the status is written here unless the worker stopped it."""
    from advisor.settings import get_settings
    from advisor.store import open_store
    from advisor.store.jobs import JobQueue
    from advisor.tune.driver import run_tune

    def stop(signum, frame):  # noqa: ANN001
        raise _Stop()

    signal.signal(signal.SIGTERM, stop)
    store = open_store(db)
    queue = JobQueue(store)
    job = queue.get(job_id)
    if job is None or job.status != "running":
        log.error("job %s is not running (%s); nothing to do", job_id, job and job.status)
        return 2
    try:
        req = tune_request(job.request, db=db, ray_address=get_settings().ray_address)
        summary = run_tune(req, on_study=lambda st: queue.set_study(job_id, st.id, st.name))
    except _Stop:
        log.warning("job %s: stopped by its worker", job_id)
        return 143
    except AdvisorError as exc:
        queue.finish(job_id, "failed", str(exc).strip().splitlines()[0][:1000])
        return 1
    except Exception as exc:
        log.exception("job %s crashed", job_id)
        if transient(exc) and job.attempts < TRANSIENT_ATTEMPTS:
            queue.finish(job_id, "queued", f"queued again after a transient database error ({_what(exc)})")
            log.warning("job %s: queued again (attempt %d of %d) to resume its study", job_id, job.attempts,
                        TRANSIENT_ATTEMPTS)
            return 75  # EX_TEMPFAIL
        queue.finish(job_id, "failed", f"the job crashed ({_what(exc)}); its log on the worker has the traceback")
        return 1
    queue.finish(job_id, "finished")
    log.info("job %s: study %s finished (%s)", job_id, summary.study_name, summary.statuses)
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    from advisor.log import setup_logging

    p = argparse.ArgumentParser(prog="python -m api.jobs",
                                description="Run one claimed tune job (the worker starts this).")
    p.add_argument("job_id")
    p.add_argument("--db", required=True)
    args = p.parse_args(argv)
    setup_logging("INFO")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    return run_job(args.job_id, args.db)


# -- the worker --------------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """In the job process before exec: SIGTERM when the worker thread that started it ends."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: an orphaned job is recovered by its stale heartbeat instead


@dataclass
class _Running:
    job: "JobRecord"
    proc: subprocess.Popen
    slots: list[str]
    stopping_since: float | None = None


class JobWorker:
    """Claims and runs queued jobs until stopped. One per process (its owner is host:pid)."""

    def __init__(self, db: str, *, slots: list[str] | None = None, poll_s: float = POLL_S) -> None:
        from advisor.settings import get_settings
        from advisor.store import open_store
        from advisor.store.jobs import JobQueue

        self.db = db
        self.store = open_store(db)
        self.queue = JobQueue(self.store)
        self.owner = self.store.owner
        self.slots = slots or device_slots()
        self.free = list(self.slots)
        self.poll_s = poll_s
        self.running: dict[str, _Running] = {}
        self.log_dir = get_settings().data_dir / "jobs"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # lifecycle
    def start(self) -> "JobWorker":
        self._thread = threading.Thread(target=self.run, name="advisor-jobs", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = STOP_GRACE_S + 5) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def run(self) -> None:
        log.info("job worker %s: %d slot(s) %s", self.owner, len(self.slots), ",".join(self.slots))
        try:
            while not self._stop.is_set():
                try:
                    self.tick()
                except AdvisorError as exc:  # the store is down: keep the jobs, try again
                    log.warning("job worker: %s", exc)
                self._stop.wait(self.poll_s)
        finally:
            self._shutdown()
            self.store.close()

    # one round
    def tick(self) -> None:
        self.queue.heartbeat(self.owner)
        for job_id in self.queue.recover():
            log.warning("job %s: its worker is gone; queued again to resume its study", job_id)
        self._reap()
        self._cancel_requested()
        while self.free:
            job = self.queue.claim_next(self.owner, len(self.free))
            if job is None:
                break
            self._launch(job)

    def _launch(self, job: "JobRecord") -> None:
        slots, self.free = self.free[:job.devices], self.free[job.devices:]
        env = dict(os.environ, ADVISOR_DATABASE_URL=self.db, PYTHONUNBUFFERED="1")
        if slots and slots[0].isdigit():  # GPU indices (not the CPU, not Ray cluster slots)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(slots)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / f"{job.id}.log"
        with open(path, "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "api.jobs", job.id, "--db", self.db], env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=_die_with_parent)
        self.running[job.id] = _Running(job=job, proc=proc, slots=slots)
        log.info("job %s: started (pid %d, slots %s, attempt %d)", job.id, proc.pid, ",".join(slots), job.attempts)

    def _reap(self) -> None:
        for job_id, run in list(self.running.items()):
            code = run.proc.poll()
            if code is None:
                if run.stopping_since is not None and time.monotonic() - run.stopping_since > STOP_GRACE_S:
                    _signal_group(run.proc, signal.SIGKILL)
                continue
            del self.running[job_id]
            self.free.extend(run.slots)
            job = self.queue.get(job_id)
            if job is None or job.status not in ("running", "cancelling"):
                continue  # the job process wrote its own end
            self._interrupt_trials(job)
            if job.cancel_requested or job.status == "cancelling":
                self.queue.finish(job_id, "cancelled", owner=self.owner)
            else:
                self.queue.finish(job_id, "failed", f"the job process exited with code {code} before it finished",
                                  owner=self.owner)

    def _cancel_requested(self) -> None:
        for job_id, run in self.running.items():
            if run.stopping_since is None:
                job = self.queue.get(job_id)
                if job is not None and job.status == "cancelling":
                    log.info("job %s: cancelling", job_id)
                    run.stopping_since = time.monotonic()
                    _signal_group(run.proc, signal.SIGTERM)

    def _interrupt_trials(self, job: "JobRecord") -> None:
        if job.study_id is not None:
            n = self.store.mark_interrupted(job.study_id)
            if n:
                log.info("job %s: %d trial(s) it left running marked interrupted", job.id, n)

    def _shutdown(self) -> None:
        """Stop every running job and queue it again (cancelled, where a cancel was asked): a
        restarted service resumes it."""
        for run in self.running.values():
            _signal_group(run.proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for run in self.running.values():
            try:
                run.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(run.proc, signal.SIGKILL)
                run.proc.wait()
        for job_id in list(self.running):
            job = self.queue.get(job_id)
            if job is None:
                continue
            self._interrupt_trials(job)
            status = "cancelled" if job.status == "cancelling" else "queued"
            self.queue.finish(job_id, status, owner=self.owner)
        self.running.clear()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


if __name__ == "__main__":
    raise SystemExit(main())

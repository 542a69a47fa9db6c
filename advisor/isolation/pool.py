"""Workers that run a workload's code for the advisor, so that code never runs in the advisor's own process.

A worker is a fork of a warm fork server (forkserver.py) that imported torch and the estimator, and
serves calls one at a time (worker.py). Each call has a time limit and a memory cap; a worker that
crashes, hangs, exits or outgrows the cap is killed with its process group, and the caller gets a
WorkloadFailed naming the part of the workload that ran (import, build, model, make_batch, loss) and
the estimator's stage. A worker that ran code from outside the advisor (a workload file or module) or
failed is retired after the call; one that ran presets serves the next call warm (torch's fake-tensor
dispatch cache and the kernel probes kept) if the caller's environment is still the one it started in.
Concurrent calls run in different workers.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, TypeVar

from advisor.errors import AdvisorError, WorkloadFailed
from advisor.isolation.forkserver import ForkedProcess, ForkServer, get_server, use_shared
from advisor.procmem import group_pss, rss_of

T = TypeVar("T")

# What a worker has imported before it is forked: torch, its fake tensors, the estimator and a trial rank's runner
# (seconds, once). One server forks both isolation workers and trial ranks (probes/forkserver.py): a second would
# import torch again beside the workload's load and the first estimate (bench/demo_orchestration.py). It runs
# under the storage logger's shim (advisor/alloclog.py), which logs nothing until a rank starts it.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.utils.checkpoint", "torch._subclasses.fake_tensor",
           "torch.utils.data", "advisor.workload", "advisor.presets", "advisor.fingerprint", "advisor.estimate",
           "advisor.estimate.estimator", "advisor.isolation.worker", "advisor.training", "probes.child",
           "probes.loader", "probes.environment"]
ALLOC_LOG = True
ENTRY = "advisor.isolation.worker:main"
POLL_S = 0.05  # how often the parent looks at a running call's worker: its exit and resident set (s)
GROUP_POLL_S = 1.0  # how often it also sums the worker's process group (calibration runs it started) (s)
CONNECT_S = 60.0  # a forked worker connects back within this (s)
MAX_CALLS = 200  # a worker is replaced after this many calls, so what its caches hold stays bounded
LOG_LINES = 12  # lines of a dead worker's output kept in the failure's detail


class PoolFull(AdvisorError):
    """Every worker is busy and the queue is full; try again after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class _Worker:
    proc: ForkedProcess
    conn: Connection
    log: Path
    env: dict[str, str]  # the caller's environment it was started with, and serves calls in
    calls: int = 0


@dataclass
class _Call:
    """What the parent knows of a running call: the workload's part running now and the estimator's stage."""

    what: str
    stage: str
    part: str | None = None
    log_offset: int = 0

    def who(self) -> str:
        from advisor.workload import PARTS

        return PARTS.get(self.part or "", self.what)


class WorkerPool:
    """At most `size` workers run calls at once; with `queue` set, more than `queue` callers waiting for one
    is a PoolFull (the API's 503) rather than an ever longer wait. Thread-safe."""

    def __init__(self, size: int = 1, queue: int | None = None) -> None:
        self.size, self.queue = size, queue
        self._lock = threading.Lock()
        self._slots = threading.Semaphore(size)
        self._idle: list[_Worker] = []
        self._busy = 0
        self._durations: collections.deque[float] = collections.deque(maxlen=32)
        self._dir: Path | None = None
        self._ids = itertools.count()
        atexit.register(self.close)

    def warm(self) -> None:
        """Start the fork server in the background (its imports take seconds), so the first call does not wait."""
        threading.Thread(target=get_server, args=(PRELOAD, ALLOC_LOG), daemon=True,
                         name="advisor-isolation-warm").start()

    def call(self, fn: Callable[..., T], *args: Any, what: str, stage: str, timeout_s: float,
             memory_cap_bytes: int, retire: bool = False, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in a worker; its value, the advisor's own error it raised, or WorkloadFailed.
        `what` names the call's subject in a failure ("the estimate"), `stage` what it does first;
        `retire`: the call runs code from outside the advisor, so its worker serves no other call."""
        with self._lock:
            if self.queue is not None and self._busy >= self.size + self.queue:
                raise PoolFull(f"all {self.size} estimate workers are busy and {self.queue} requests wait; "
                               "try again shortly", self._retry_after())
            self._busy += 1
        try:
            with self._slots:
                started = time.monotonic()
                worker = self._take()
                keep = False
                try:
                    value, keep = self._run(worker, _Call(what, stage), fn, args, kwargs, timeout_s, memory_cap_bytes)
                    return value
                finally:
                    worker.calls += 1
                    small = rss_of(worker.proc.pid) < memory_cap_bytes / 2
                    if keep and not retire and worker.calls < MAX_CALLS and small:
                        with self._lock:
                            self._idle.append(worker)
                    else:
                        self._retire(worker)
                    self._durations.append(time.monotonic() - started)
        finally:
            with self._lock:
                self._busy -= 1

    def _retry_after(self) -> int:
        """Seconds until a queued request would likely start: the recent mean call times the queue per worker."""
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        return max(1, round(mean * (self._busy + 1) / self.size))

    def _run(self, worker: _Worker, call: _Call, fn: Callable, args: tuple, kwargs: dict, timeout_s: float,
             cap: int) -> tuple[Any, bool]:
        """(the call's value, whether the worker may serve again); raises what the call raised or WorkloadFailed."""
        from advisor.estimate.stages import report

        call.log_offset = worker.log.stat().st_size if worker.log.exists() else 0
        try:
            worker.conn.send((fn, args, kwargs))
        except OSError:  # it died idle (the kernel's out-of-memory killer, say)
            raise self._died(worker, call) from None
        deadline = time.monotonic() + timeout_s
        next_group = time.monotonic() + GROUP_POLL_S
        while True:
            if worker.conn.poll(POLL_S):
                try:
                    msg = worker.conn.recv()
                except (EOFError, OSError):
                    raise self._died(worker, call) from None
                if msg[0] == "stage":
                    call.stage = msg[1]
                    report(msg[1])
                elif msg[0] == "part":
                    call.part = msg[1]
                elif msg[0] == "ok":
                    return msg[1], True
                else:
                    raise self._answered_failure(msg, call)
                continue
            if worker.proc.exitcode is not None:
                raise self._died(worker, call)
            now = time.monotonic()
            if now > deadline:
                _kill(worker)
                raise WorkloadFailed(f"{call.who()} did not finish within {timeout_s:g} s while {call.stage}; "
                                     "its process was killed", status="timeout", detail=_log_tail(worker, call))
            rss = rss_of(worker.proc.pid)
            if now >= next_group:
                next_group = now + GROUP_POLL_S
                rss = max(rss, group_pss(worker.proc.pid))
            if rss > cap:
                _kill(worker)
                raise WorkloadFailed(f"{call.who()} reached {rss / 2**20:,.0f} MiB, past the memory cap of "
                                     f"{cap / 2**20:,.0f} MiB, while {call.stage}; its process was killed",
                                     status="oom", detail=_log_tail(worker, call))

    @staticmethod
    def _answered_failure(msg: tuple, call: _Call) -> BaseException:
        """The exception for a worker's 'raised' or 'exited' answer."""
        call.part = msg[1] or call.part
        if msg[0] == "exited":
            code, tail = msg[2], msg[3]
            return WorkloadFailed(f"{call.who()} exited (SystemExit: {code!r}) while {call.stage}", status="error",
                                  detail=tail)
        error, type_name, text, tail = msg[2:]
        if error is not None:  # the advisor's own error (a bad input, an estimate it cannot make): as raised
            return error
        oom = type_name == "MemoryError" or "can't allocate memory" in text
        first = text.strip().splitlines()[0] if text.strip() else ""
        return WorkloadFailed(f"{call.who()} raised {type_name}{': ' + first if first else ''} while {call.stage}",
                              status="oom" if oom else "error", detail=tail)

    def _died(self, worker: _Worker, call: _Call) -> WorkloadFailed:
        """The failure of a worker that went away mid-call: killed by a signal, or exited."""
        worker.proc.join(5)
        code = worker.proc.exitcode
        _kill(worker)
        tail = _log_tail(worker, call)
        if code == -signal.SIGKILL:  # not ours: most likely the kernel's out-of-memory killer
            return WorkloadFailed(f"{call.who()} was killed (SIGKILL, most likely by the kernel for want of memory) "
                                  f"while {call.stage}", status="oom", detail=tail)
        if code is not None and code < 0:
            return WorkloadFailed(f"{call.who()} crashed ({signal.Signals(-code).name}) while {call.stage}",
                                  status="crashed", detail=tail)
        return WorkloadFailed(f"{call.who()} exited with code {code} while {call.stage}", status="error", detail=tail)

    def _take(self) -> _Worker:
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                # a server's workers die with it; one started in another environment would run the call in that
                if worker.proc.exitcode is None and worker.proc.server.alive() and worker.env == _environment():
                    return worker
                self._retire(worker)
        return self._spawn()

    def _spawn(self) -> _Worker:
        server = get_server(PRELOAD, ALLOC_LOG)
        if not server.wait_ready():
            raise AdvisorError("the isolation fork server did not start (see the log above)")
        n = next(self._ids)
        directory = self._directory()
        sock_path, log = directory / f"w{n}.sock", directory / f"w{n}.log"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(sock_path))
            listener.listen(1)
            listener.settimeout(CONNECT_S)
            env = _environment()
            proc = server.spawn(ENTRY, [str(sock_path), str(log)], dict(os.environ))
            try:
                sock, _ = listener.accept()
            except OSError as exc:  # timed out: the fork never connected
                _kill_pid(proc.pid)
                raise AdvisorError(f"an isolation worker did not start: {exc}") from exc
        finally:
            listener.close()
            sock_path.unlink(missing_ok=True)
        sock.setblocking(True)
        return _Worker(proc, Connection(sock.detach()), log, env)

    def _directory(self) -> Path:
        """A private directory for the workers' sockets and logs (short: a socket's path has 107 bytes at most)."""
        with self._lock:
            if self._dir is None:
                self._dir = Path(tempfile.mkdtemp(prefix="advisor-isolation-"))
            return self._dir

    def _retire(self, worker: _Worker) -> None:
        _kill(worker)
        worker.proc.join(5)
        worker.proc.close()
        worker.log.unlink(missing_ok=True)

    def close(self) -> None:
        """Stop every idle worker and remove the pool's directory (at exit; busy calls finish on their own)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            self._retire(worker)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


# Set by torch itself on first use in the caller (inductor's and triton's default cache dirs): no change of setting.
_SET_BY_TORCH = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def _environment() -> dict[str, str]:
    """The caller's environment, as a warm worker must match it to serve a call."""
    return {k: v for k, v in os.environ.items() if k not in _SET_BY_TORCH}


def _kill_pid(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the worker leads its group: it and what it started
    except (ProcessLookupError, PermissionError):
        pass


def _kill(worker: _Worker) -> None:
    worker.conn.close()
    _kill_pid(worker.proc.pid)


def _log_tail(worker: _Worker, call: _Call) -> str:
    try:
        with open(worker.log, "rb") as f:
            f.seek(call.log_offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-LOG_LINES:])


_DEFAULT: WorkerPool | None = None
_DEFAULT_LOCK = threading.Lock()


def fork_server() -> ForkServer:
    """This process's isolation fork server (started now if it was not: its imports take seconds)."""
    return get_server(PRELOAD, ALLOC_LOG)


def use_shared_server(address: str) -> None:
    """Fork this process's isolation workers through the server another process of this host started (`address`)."""
    use_shared(PRELOAD, ALLOC_LOG, address)


def default_pool() -> WorkerPool:
    """This process's pool of one worker (the CLI, the tuner, a trial's runner)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = WorkerPool(1)
        return _DEFAULT

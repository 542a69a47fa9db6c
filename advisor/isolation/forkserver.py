"""A warm fork server: torch is imported once, each trial rank or isolation worker is a fork of it.

`import torch` costs ~2 s here; a trial's overhead goal is under 2 s, so processes are forked from
a server that imported its modules and did nothing else (no threads, no CUDA, no earlier trial),
which makes each fork as clean as a fresh process. Unlike multiprocessing's forkserver, the server
never re-imports the caller's `__main__` (a user's script would run again in every fork).

`python -m advisor.isolation.forkserver MODULE...` imports the modules, then forks on request.
Protocol, one JSON object per line. To the server: {"id", "entry": "module:function", "argv", "env",
"cwd", "sys_path"}. From it: {"id", "pid"} when forked, {"pid", "exit"} when reaped (exit < 0: signal).
The forked process runs entry(*argv) and must redirect its stdout: the server's is the protocol.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
from typing import Any

# --- the server (python -m advisor.isolation.forkserver MODULE...) ------------------------------

def _send(msg: dict[str, Any]) -> None:
    os.write(1, (json.dumps(msg) + "\n").encode())


_CHILDREN: set[int] = set()
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def _fork(msg: dict[str, Any]) -> None:
    server = os.getpid()
    pid = os.fork()
    if pid == 0:  # the forked process: never returns
        try:
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            _CHILDREN.clear()
            _die_with_parent()
            if os.getppid() != server:  # the server died before the line above took effect
                os._exit(70)
            os.close(0)
            os.chdir(msg["cwd"])
            sys.path[:] = msg["sys_path"]
            os.environ.clear()
            os.environ.update(msg["env"])
            module, _, name = msg["entry"].partition(":")
            getattr(importlib.import_module(module), name)(*msg["argv"])
        finally:
            os._exit(70)  # entry exits by itself; reaching here means it could not start
    _CHILDREN.add(pid)
    _send({"id": msg["id"], "pid": pid})


def own_group(log_path: str, mode: int) -> None:
    """A forked process's first step: lead a new session and process group (its client kills it and what it
    starts together), send its output to `log_path` (opened with `mode`: os.O_TRUNC or os.O_APPEND) and take
    OMP_NUM_THREADS, which libgomp read when the server loaded torch."""
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | mode, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if "OMP_NUM_THREADS" in os.environ:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux's PR_SET_PDEATHSIG), so nothing
    forked outlives a server that was killed before it could stop its children."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the server's own cleanup is all there is


def _stop_children(*_: object) -> None:
    """Kill every forked process's group (each leads its own: it and what it started), then exit."""
    for pid in _CHILDREN:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    os._exit(0)


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        _CHILDREN.discard(pid)
        _send({"pid": pid, "exit": code})


def serve(preload: list[str]) -> None:
    """Import `preload`, then fork on request until stdin closes or the client's process is gone (even killed
    outright: the forked processes go with the server), or a signal stops it."""
    # Watched here, not by a parent-death signal: that follows the client's thread that started the server
    # (a pool's first caller, a warm-up thread), which may end long before the client does.
    client = os.getppid()
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop_children)
    for name in preload:
        importlib.import_module(name)
    _send({"ready": True})
    buffer = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.05)
        if ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:  # the client is gone (even killed): what it forked goes with it
                _stop_children()
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                _fork(json.loads(line))
        _reap()
        if os.getppid() != client:  # reparented: the client died, and stdin may live on in a process it forked
            _stop_children()


# --- the client ---------------------------------------------------------------------------------

class ForkedProcess:
    """One forked process, seen from the client: its pid and, once reaped, its exit code."""

    def __init__(self, server: "ForkServer", pid: int) -> None:
        self.server, self.pid = server, pid

    @property
    def exitcode(self) -> int | None:
        with self.server.cond:
            return self.server.exits.get(self.pid)

    def join(self, timeout: float | None = None) -> None:
        with self.server.cond:
            self.server.cond.wait_for(lambda: self.pid in self.server.exits or self.server.dead, timeout)

    def close(self) -> None:
        with self.server.cond:
            self.server.exits.pop(self.pid, None)


class ForkServer:
    """Starts `python -m advisor.isolation.forkserver PRELOAD...` and forks through it; thread-safe."""

    def __init__(self, preload: list[str], alloc_log: bool = False) -> None:
        from advisor.settings import get_settings

        # Inductor fixes its cache dir when it is imported, which the server does in PRELOAD: give
        # it the advisor's now, so compiled trials share one cache (under the data dir) per run.
        env = dict(os.environ)
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(get_settings().data_dir / "inductor"))
        if alloc_log:  # its forks can log their tensor storages (advisor/alloclog.py)
            from advisor.alloclog import preload_env

            env = preload_env(env)
        self.proc = subprocess.Popen([sys.executable, "-m", "advisor.isolation.forkserver", *preload],
                                     stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=None, bufsize=0, env=env)
        self.cond = threading.Condition()
        self.exits: dict[int, int] = {}
        self.pids: dict[int, int] = {}
        self.ready = self.dead = False
        self.next_id = 0
        threading.Thread(target=self._read, daemon=True, name="advisor-forkserver-reader").start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.cond:
                if "ready" in msg:
                    self.ready = True
                elif "exit" in msg:
                    self.exits[msg["pid"]] = msg["exit"]
                else:
                    self.pids[msg["id"]] = msg["pid"]
                self.cond.notify_all()
        with self.cond:
            self.dead = True
            self.cond.notify_all()

    def wait_ready(self, timeout: float = 120.0) -> bool:
        """Block until the server has imported PRELOAD (True), or died or `timeout` passed (False)."""
        with self.cond:
            self.cond.wait_for(lambda: self.ready or self.dead, timeout)
            return self.ready and self.alive()

    def alive(self) -> bool:
        return self.proc.poll() is None and not self.dead

    def spawn(self, entry: str, argv: list[str], env: dict[str, str], timeout: float = 120.0) -> ForkedProcess:
        """Fork `entry` ("module:function") with `argv`, this process's cwd and sys.path, and `env`."""
        with self.cond:
            msg_id, self.next_id = self.next_id, self.next_id + 1
            line = json.dumps({"id": msg_id, "entry": entry, "argv": argv, "env": env, "cwd": os.getcwd(),
                               "sys_path": sys.path})
            assert self.proc.stdin is not None
            self.proc.stdin.write((line + "\n").encode())
            if not self.cond.wait_for(lambda: msg_id in self.pids or self.dead, timeout):
                raise RuntimeError("the fork server did not answer")
            if self.dead:
                raise RuntimeError(f"the fork server exited (code {self.proc.poll()})")
            return ForkedProcess(self, self.pids.pop(msg_id))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=10)


_LOCK = threading.Lock()
_SERVERS: dict[tuple[str | bool, ...], ForkServer] = {}


def get_server(preload: list[str], alloc_log: bool = False) -> ForkServer:
    """This process's server for `preload` (`alloc_log`: under the storage logger's shim), started on first use
    and again if it died."""
    key = (*preload, alloc_log)
    with _LOCK:
        server = _SERVERS.get(key)
        if server is None or not server.alive():
            server = _SERVERS[key] = ForkServer(preload, alloc_log)
        return server


if __name__ == "__main__":
    serve(sys.argv[1:])

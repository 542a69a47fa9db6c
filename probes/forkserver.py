"""A warm fork server for trials: torch is imported once, each trial rank is a fork of it.

`import torch` costs ~2 s here; a trial's overhead goal is under 2 s, so ranks are forked from
a server that imported torch and did nothing else (no threads, no CUDA, no earlier trial), which
makes each fork as clean as a fresh process. Unlike multiprocessing's forkserver, the server never
re-imports the caller's `__main__` (a user's script would run again in every trial).

Protocol, one JSON object per line. To the server: {"id", "argv": [request, log], "env", "cwd",
"sys_path"}. From it: {"id", "pid"} when forked, {"pid", "exit"} when reaped (exit < 0: signal).
"""

from __future__ import annotations

import importlib
import json
import os
import select
import subprocess
import sys
import threading
from typing import Any

# torch._dynamo: building any torch.optim optimizer imports it (~3 s here); torch.distributed for DDP/FSDP.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.utils.checkpoint", "torch.utils.data",
           "advisor.training", "advisor.workload", "advisor.presets", "probes.child", "probes.loader",
           "probes.environment"]


# --- the server (python -m probes.forkserver) ---------------------------------------------------

def _send(msg: dict[str, Any]) -> None:
    os.write(1, (json.dumps(msg) + "\n").encode())


_CHILDREN: set[int] = set()


def _fork(msg: dict[str, Any]) -> None:
    pid = os.fork()
    if pid == 0:  # the trial rank: never returns
        try:
            os.close(0)
            os.chdir(msg["cwd"])
            sys.path[:] = msg["sys_path"]
            os.environ.clear()
            os.environ.update(msg["env"])
            from probes.child import entry

            entry(*msg["argv"])
        finally:
            os._exit(70)  # entry exits by itself; reaching here means it could not start
    _CHILDREN.add(pid)
    _send({"id": msg["id"], "pid": pid})


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


def serve() -> None:
    """Preload, then fork on request until stdin closes (the client is gone)."""
    for name in PRELOAD:
        importlib.import_module(name)
    _send({"ready": True})
    buffer = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.05)
        if ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:  # the client is gone (even killed): its running trials go with it
                for pid in _CHILDREN:
                    try:
                        os.killpg(pid, 9)  # each rank leads its own group: it and its DataLoader workers
                    except OSError:
                        pass
                return
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                _fork(json.loads(line))
        _reap()


# --- the client ---------------------------------------------------------------------------------

class TrialProcess:
    """One forked rank, seen from the client: its pid and, once reaped, its exit code."""

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
    """Starts `python -m probes.forkserver` and forks ranks through it; thread-safe."""

    def __init__(self) -> None:
        from advisor.settings import get_settings

        # Inductor fixes its cache dir when it is imported, which the server does in PRELOAD: give
        # it the advisor's now, so compiled trials share one cache (under the data dir) per run.
        env = dict(os.environ)
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(get_settings().data_dir / "inductor"))
        self.proc = subprocess.Popen([sys.executable, "-m", "probes.forkserver"], stdin=subprocess.PIPE,
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

    def spawn(self, argv: list[str], env: dict[str, str], timeout: float = 120.0) -> TrialProcess:
        with self.cond:
            msg_id, self.next_id = self.next_id, self.next_id + 1
            line = json.dumps({"id": msg_id, "argv": argv, "env": env, "cwd": os.getcwd(), "sys_path": sys.path})
            assert self.proc.stdin is not None
            self.proc.stdin.write((line + "\n").encode())
            if not self.cond.wait_for(lambda: msg_id in self.pids or self.dead, timeout):
                raise RuntimeError("the trial fork server did not answer")
            if self.dead:
                raise RuntimeError(f"the trial fork server exited (code {self.proc.poll()})")
            return TrialProcess(self, self.pids.pop(msg_id))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=10)


_LOCK = threading.Lock()
_SERVER: ForkServer | None = None


def get_server() -> ForkServer:
    """The process-wide server, started on first use and again if it died."""
    global _SERVER
    with _LOCK:
        if _SERVER is None or not _SERVER.alive():
            _SERVER = ForkServer()
        return _SERVER


if __name__ == "__main__":
    serve()

"""A warm fork server: torch is imported once, each trial rank or isolation worker is a fork of it.

`import torch` costs ~2 s here; a trial's overhead goal is under 2 s, so processes are forked from
a server that imported its modules and did nothing else (no threads, no CUDA, no earlier trial),
which makes each fork as clean as a fresh process. Unlike multiprocessing's forkserver, the server
never re-imports the caller's `__main__` (a user's script would run again in every fork).

`python -m advisor.isolation.forkserver --listen-fd FD MODULE...` imports the modules, then forks on
request: for the process that started it (its owner, over stdin and stdout), and for other processes of
this host that attach to its Unix socket (FD, bound and listening before the server starts), such as a
tuner's Ray actor, which then imports nothing before its first trial. Protocol, one JSON object per line.
To the server: {"id", "entry": "module:function", "argv", "env", "cwd", "sys_path"}. From it: {"ready"}
once imported, {"id", "pid"} when forked, {"pid", "exit"} when reaped (exit < 0: signal), each to the
client that asked. The forked process runs entry(*argv) and must redirect its stdout: the server's is the
protocol. What a client forked dies when the client lets go; everything forked dies with the owner.
"""

from __future__ import annotations

import importlib
import itertools
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# --- the server (python -m advisor.isolation.forkserver MODULE...) ------------------------------

OWNER = 0  # the client that started the server: its stdin (fd 0) and stdout
_CLIENTS: dict[int, socket.socket] = {}  # attached clients by number (1, 2, ...; never reused)
_CHILDREN: dict[int, int] = {}  # forked pid -> the client it answers to
_LISTENER: list[socket.socket] = []  # the socket clients attach to, if any; its directory is removed at exit
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def _send(client: int, msg: dict[str, Any]) -> None:
    line = (json.dumps(msg) + "\n").encode()
    if client == OWNER:
        try:
            os.write(1, line)
        except OSError:  # the owner is gone (it may exit while the server imports): so is what it forked
            _stop_children()
    elif client in _CLIENTS:
        try:
            _CLIENTS[client].sendall(line)
        except OSError:
            _detach(client)


def _fork(client: int, msg: dict[str, Any]) -> None:
    server = os.getpid()
    pid = os.fork()
    if pid == 0:  # the forked process: never returns
        try:
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            _CHILDREN.clear()
            for sock in [*_CLIENTS.values(), *_LISTENER]:
                sock.close()
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
    _CHILDREN[pid] = client
    _send(client, {"id": msg["id"], "pid": pid})


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


def _kill_group(pid: int) -> None:
    """SIGKILL a forked process's group (it leads one once its entry called `own_group`), and the process."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _detach(client: int) -> None:
    """A client that went away: what it forked is killed (each leads its own group: it and what it started)."""
    sock = _CLIENTS.pop(client, None)
    if sock is not None:
        sock.close()
    for pid, owner in _CHILDREN.items():
        if owner == client:
            _kill_group(pid)


def _stop_children(*_: object) -> None:
    """Kill every forked process's group, remove the socket, then exit."""
    for pid in _CHILDREN:
        _kill_group(pid)
    if _LISTENER:
        shutil.rmtree(Path(_LISTENER[0].getsockname()).parent, ignore_errors=True)
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
        client = _CHILDREN.pop(pid, None)
        if client is not None:
            _send(client, {"pid": pid, "exit": code})


def _requests(client: int, buffers: dict[int, bytes], chunk: bytes) -> None:
    """Fork for each whole line `client` has sent."""
    buffers[client] = buffers.get(client, b"") + chunk
    while b"\n" in buffers[client]:
        line, buffers[client] = buffers[client].split(b"\n", 1)
        _fork(client, json.loads(line))


def serve(preload: list[str], listen_fd: int | None = None) -> None:
    """Import `preload`, then fork on request until stdin closes or the owner's process is gone (even killed
    outright: the forked processes go with the server), or a signal stops it. `listen_fd`: the listening socket
    other processes attach to; one that connects during the imports hears "ready" after them."""
    # Watched here, not by a parent-death signal: that follows the client's thread that started the server
    # (a pool's first caller, a warm-up thread), which may end long before the client does.
    owner = os.getppid()
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop_children)
    if listen_fd is not None:
        _LISTENER.append(socket.socket(fileno=listen_fd))
    for name in preload:
        importlib.import_module(name)
    _send(OWNER, {"ready": True})
    buffers: dict[int, bytes] = {}
    numbers = itertools.count(1)
    while True:
        by_socket = {sock: n for n, sock in _CLIENTS.items()}
        ready, _, _ = select.select([0, *_LISTENER, *by_socket], [], [], 0.05)
        for source in ready:
            if source == 0:
                chunk = os.read(0, 1 << 16)
                if not chunk:  # the owner is gone (even killed): what it forked goes with it
                    _stop_children()
                _requests(OWNER, buffers, chunk)
            elif source in _LISTENER:
                sock, _ = source.accept()
                client = next(numbers)
                _CLIENTS[client] = sock
                _send(client, {"ready": True})
            else:
                client = by_socket[source]
                try:
                    chunk = source.recv(1 << 16)
                except OSError:
                    chunk = b""
                if not chunk:
                    _detach(client)
                    buffers.pop(client, None)
                else:
                    _requests(client, buffers, chunk)
        _reap()
        if os.getppid() != owner:  # reparented: the owner died, and stdin may live on in a process it forked
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


def kill_groups(procs: list[ForkedProcess]) -> None:
    """SIGKILL the process group of each forked process (each leads its own: `own_group`): it and what it started,
    such as DataLoader workers."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # gone already (PermissionError: the pid was reused by a process not ours)


def reap(procs: list[ForkedProcess]) -> None:
    """Kill what is left of their groups (`kill_groups`) and collect each forked process."""
    kill_groups(procs)
    for p in procs:
        p.join(timeout=10)


class ForkServer:
    """Starts `python -m advisor.isolation.forkserver --listen-fd FD PRELOAD...` and forks through it (other
    processes attach at `address`), or, made by `attach`, forks through another process's server; thread-safe."""

    def __init__(self, preload: list[str], alloc_log: bool = False) -> None:
        from advisor.settings import get_settings

        # Inductor fixes its cache dir when it is imported, which the server does in PRELOAD: give
        # it the advisor's now, so compiled trials share one cache (under the data dir) per run.
        env = dict(os.environ)
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(get_settings().data_dir / "inductor"))
        if alloc_log:  # its forks can log their tensor storages (advisor/alloclog.py)
            from advisor.alloclog import preload_env

            env = preload_env(env)
        self._dir: Path | None = Path(tempfile.mkdtemp(prefix="advisor-fork-"))  # private (0700)
        self.address: str | None = str(self._dir / "socket")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:  # bound here, so a client may attach as soon as this returns
            listener.bind(self.address)
            listener.listen(16)
            listen = ["--listen-fd", str(listener.fileno())]
        except OSError:  # a path too long for AF_UNIX (a long TMPDIR): no other process can attach
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir, self.address, listen = None, None, []
        try:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, "-m", "advisor.isolation.forkserver", *listen, *preload], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=None, bufsize=0, env=env,
                pass_fds=(listener.fileno(),) if listen else ())
        finally:
            listener.close()
        self._sock: socket.socket | None = None
        self._start_reading(self.proc.stdout)

    @classmethod
    def attach(cls, address: str) -> "ForkServer":
        """A client of the server another process of this host started, listening at `address`; OSError where
        none does. What this client forks dies when it closes, or when this process ends."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(address)
        except OSError:
            sock.close()
            raise
        self = cls.__new__(cls)
        self._dir, self.address, self.proc, self._sock = None, address, None, sock
        self._start_reading(sock.makefile("rb"))
        return self

    def _start_reading(self, stream) -> None:  # noqa: ANN001 - a binary file the server's lines come from
        self.cond = threading.Condition()
        self.exits: dict[int, int] = {}
        self.pids: dict[int, int] = {}
        self.ready = self.dead = False
        self.next_id = 0
        threading.Thread(target=self._read, args=(stream,), daemon=True, name="advisor-forkserver-reader").start()

    def _read(self, stream) -> None:  # noqa: ANN001
        try:
            for line in stream:
                msg = json.loads(line)
                with self.cond:
                    if "ready" in msg:
                        self.ready = True
                    elif "exit" in msg:
                        self.exits[msg["pid"]] = msg["exit"]
                    else:
                        self.pids[msg["id"]] = msg["pid"]
                    self.cond.notify_all()
        except (OSError, ValueError):  # an attached client's socket closed under the reader
            pass
        with self.cond:
            self.dead = True
            self.cond.notify_all()

    def wait_ready(self, timeout: float = 120.0) -> bool:
        """Block until the server has imported PRELOAD (True), or died or `timeout` passed (False)."""
        with self.cond:
            self.cond.wait_for(lambda: self.ready or self.dead, timeout)
            return self.ready and self.alive()

    def alive(self) -> bool:
        return (self.proc is None or self.proc.poll() is None) and not self.dead

    def _write(self, data: bytes) -> None:
        if self._sock is not None:
            self._sock.sendall(data)
        else:
            assert self.proc is not None and self.proc.stdin is not None
            self.proc.stdin.write(data)

    def spawn(self, entry: str, argv: list[str], env: dict[str, str], timeout: float = 120.0) -> ForkedProcess:
        """Fork `entry` ("module:function") with `argv`, this process's cwd and sys.path, and `env`."""
        with self.cond:
            msg_id, self.next_id = self.next_id, self.next_id + 1
            line = json.dumps({"id": msg_id, "entry": entry, "argv": argv, "env": env, "cwd": os.getcwd(),
                               "sys_path": sys.path})
            try:
                self._write((line + "\n").encode())
            except OSError as exc:
                raise RuntimeError(f"the fork server is gone ({exc})") from exc
            if not self.cond.wait_for(lambda: msg_id in self.pids or self.dead, timeout):
                raise RuntimeError("the fork server did not answer")
            if self.dead:
                code = self.proc.poll() if self.proc is not None else "unknown: another process's"
                raise RuntimeError(f"the fork server exited (code {code})")
            return ForkedProcess(self, self.pids.pop(msg_id))

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader: it marks this client dead
            except OSError:
                pass
            self._sock.close()
            return
        assert self.proc is not None
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=10)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


_LOCK = threading.Lock()
_SERVERS: dict[tuple[str | bool, ...], ForkServer] = {}
_SHARED: dict[tuple[str | bool, ...], str] = {}  # servers of another process to fork through, by the same key
_UNANSWERED: set[str] = set()  # addresses where no server answered: not tried again (each try may start one here)


def get_server(preload: list[str], alloc_log: bool = False) -> ForkServer:
    """This process's server for `preload` (`alloc_log`: under the storage logger's shim): the one `use_shared`
    named while it answers, else one of its own, started on first use and again if it died."""
    key = (*preload, alloc_log)
    with _LOCK:
        server = _SERVERS.get(key)
        if server is None or not server.alive():
            server = None
            address = _SHARED.pop(key, None)
            if address is not None:
                try:
                    server = ForkServer.attach(address)
                except OSError as exc:
                    _UNANSWERED.add(address)
                    log.warning("the shared fork server at %s did not answer (%s); starting one here", address, exc)
            server = _SERVERS[key] = server or ForkServer(preload, alloc_log)
        return server


def use_shared(preload: list[str], alloc_log: bool, address: str) -> None:
    """Have `get_server(preload, alloc_log)` fork through the server listening at `address` (started by another
    process of this host with the same `preload` and `alloc_log`) from now on, until that server is gone; then
    through one of this process's own, kept where the same address is named again."""
    key = (*preload, alloc_log)
    with _LOCK:
        current = _SERVERS.get(key)
        if address in _UNANSWERED or current is not None and current.alive() and current.address == address:
            return
        _SHARED[key] = address
        if current is not None:  # what it forked dies with it: a caller shares before it forks anything
            current.close()
        _SERVERS.pop(key, None)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--listen-fd"]:
        serve(sys.argv[3:], listen_fd=int(sys.argv[2]))
    else:
        serve(sys.argv[1:])

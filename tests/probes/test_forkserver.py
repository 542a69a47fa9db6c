"""The trial fork server, seen from its client: readiness after its imports, and a server that died."""

from __future__ import annotations

import time

from probes.forkserver import ENTRY, trial_server


def test_wait_ready_returns_once_the_imports_are_done_and_false_once_the_server_is_gone(tmp_path) -> None:
    server = trial_server()
    try:
        assert not server.ready  # just started: importing torch and its compiler stack takes seconds
        assert server.wait_ready(120)
        # ready means forking is all that is left: a rank (one that fails at once on a missing request) is
        # forked and reaped in well under the seconds the imports took
        t0 = time.monotonic()
        argv = [str(tmp_path / "missing.json"), str(tmp_path / "rank0.log")]
        rank = server.spawn(ENTRY, argv, {"PATH": "/usr/bin:/bin"})
        rank.join(30)
        assert rank.exitcode not in (None, 0) and time.monotonic() - t0 < 5
        server.proc.kill()
        server.proc.wait(10)
        t0 = time.monotonic()
        assert not server.wait_ready(10)  # dead: answered at once, not after the timeout
        assert time.monotonic() - t0 < 5
    finally:
        if server.proc.poll() is None:
            server.close()

"""The fork server trial ranks start from (advisor/isolation/forkserver.py): the isolation workers' own, which
imports what a rank needs too."""

from __future__ import annotations

from advisor.isolation.forkserver import ForkServer
from advisor.isolation.pool import ALLOC_LOG, PRELOAD, fork_server

ENTRY = "probes.child:entry"  # each rank runs entry(request_path, log_path)


def get_server() -> ForkServer:
    """This process's fork server (the isolation workers' own), started on first use and again if it died, or the
    one `advisor.isolation.pool.use_shared_server` named; under the storage logger's shim (advisor/alloclog.py), so
    a CPU rank of a parallel layout measures its live tensor bytes."""
    return fork_server()


def trial_server() -> ForkServer:
    """A new trial fork server of this process's own (tests that stop it)."""
    return ForkServer(PRELOAD, ALLOC_LOG)

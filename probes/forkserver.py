"""The fork server trial ranks start from (advisor/isolation/forkserver.py): the isolation workers' own, which
imports what a rank needs too."""

from __future__ import annotations

from advisor.isolation.forkserver import ForkServer
from advisor.isolation.forkserver import get_server as _get_server
from advisor.isolation.forkserver import use_shared as _use_shared

# the isolation workers' server (advisor/isolation/pool.py): torch._dynamo, which building any torch.optim
# optimizer imports (~1 s), torch.distributed for DDP/FSDP, the rank's runner
from advisor.isolation.pool import ALLOC_LOG, PRELOAD

ENTRY = "probes.child:entry"  # each rank runs entry(request_path, log_path)


def get_server() -> ForkServer:
    """This process's trial fork server, started on first use and again if it died; under the storage logger's
    shim (advisor/alloclog.py), so a CPU rank of a parallel layout measures its live tensor bytes."""
    return _get_server(PRELOAD, ALLOC_LOG)


def use_shared(address: str) -> None:
    """Fork this process's ranks through the trial server another process of this host started (its `address`)."""
    _use_shared(PRELOAD, ALLOC_LOG, address)


def trial_server() -> ForkServer:
    """A new trial fork server of this process's own (tests that stop it)."""
    return ForkServer(PRELOAD, ALLOC_LOG)

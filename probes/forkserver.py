"""The trial runner's fork server (advisor/isolation/forkserver.py) and what it imports before forking ranks."""

from __future__ import annotations

from advisor.isolation.forkserver import ForkServer
from advisor.isolation.forkserver import get_server as _get_server
from advisor.isolation.forkserver import use_shared as _use_shared

# torch._dynamo: building any torch.optim optimizer imports it (~3 s here); torch.distributed for DDP/FSDP.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.utils.checkpoint", "torch.utils.data",
           "advisor.training", "advisor.workload", "advisor.presets", "probes.child", "probes.loader",
           "probes.environment"]
ENTRY = "probes.child:entry"  # each rank runs entry(request_path, log_path)


def get_server() -> ForkServer:
    """This process's trial fork server, started on first use and again if it died; under the storage logger's
    shim (advisor/alloclog.py), so a CPU rank of a parallel layout measures its live tensor bytes."""
    return _get_server(PRELOAD, alloc_log=True)


def use_shared(address: str) -> None:
    """Fork this process's ranks through the trial server another process of this host started (its `address`)."""
    _use_shared(PRELOAD, True, address)


def trial_server() -> ForkServer:
    """A new trial fork server of this process's own (tests that stop it)."""
    return ForkServer(PRELOAD, alloc_log=True)

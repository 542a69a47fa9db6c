"""Run a function on a few gloo ranks of this machine, each a process forked from the warm fork server
(advisor/isolation/forkserver.py: torch imported once), and collect what each returns. For the programs of
tests/advisor/test_layouts.py (ring_ranks.py, loss_parallel_ranks.py, accumulate_ranks.py)."""

from __future__ import annotations

import importlib
import os
import tempfile
from typing import Callable


def entry(target: str, rank: str, world: str, port: str, path: str, log_path: str) -> None:
    """A forked rank (advisor.parallel.measure.forked_rank): `target` ("module:function") on the gloo group; what
    it returns is written to `path`.RANK."""
    from advisor.parallel.measure import forked_rank

    def body() -> None:
        import torch.distributed as dist

        module, _, name = target.partition(":")
        fn = getattr(importlib.import_module(module), name)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group("gloo", rank=int(rank), world_size=int(world))
        text = fn(int(rank), int(world))
        dist.barrier()
        dist.destroy_process_group()
        with open(f"{path}.{rank}", "w") as f:
            f.write(text)

    forked_rank(log_path, body)


def run_ranks(fn: Callable[[int, int], str], world: int, timeout_s: float = 300.0) -> list[str]:
    """`fn(rank, world)` (a module-level function of an importable module) on `world` gloo ranks in a process group
    of their own; what each rank returned, in rank order. AssertionError naming the first rank that failed."""
    from advisor.isolation.forkserver import reap
    from advisor.isolation.pool import fork_server
    from advisor.parallel.measure import free_port, wait_forked

    with tempfile.TemporaryDirectory() as tmp:
        path, port = os.path.join(tmp, "out"), str(free_port())
        logs = [os.path.join(tmp, f"{rank}.log") for rank in range(world)]
        server, procs = fork_server(), []
        try:
            for rank in range(world):
                procs.append(server.spawn("tests.advisor.gloo_ranks:entry",
                                          [f"{fn.__module__}:{fn.__name__}", str(rank), str(world), port, path,
                                           logs[rank]], dict(os.environ)))
            errors = wait_forked(procs, logs, timeout_s)
        finally:
            reap(procs)
        assert not errors, errors[0]
        return [open(f"{path}.{r}").read() for r in range(world)]

"""Run a function on a few gloo ranks of this machine, each in its own process, and collect what each returns.
For the programs tests/advisor/test_layouts.py runs as `python -m tests.advisor.<name>`."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Callable


def _rank(rank: int, world: int, port: int, path: str, fn: Callable[[int, int], str]) -> None:
    import torch.distributed as dist

    from advisor.trial import GLOO_EXIT_PAUSE_S

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    text = fn(rank, world)
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(GLOO_EXIT_PAUSE_S)  # gloo's workers finish freeing before the interpreter goes
    with open(f"{path}.{rank}", "w") as f:
        f.write(text)


def run_ranks(fn: Callable[[int, int], str], world: int) -> list[str]:
    """`fn(rank, world)` (a module-level function) on `world` gloo ranks in a process group of their own; what each
    rank returned, in rank order."""
    import torch.multiprocessing as mp

    from advisor.parallel.measure import free_port

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out")
        mp.spawn(_rank, args=(world, free_port(), path, fn), nprocs=world)
        return [open(f"{path}.{r}").read() for r in range(world)]

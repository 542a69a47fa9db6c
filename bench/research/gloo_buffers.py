#!/usr/bin/env python
"""What gloo allocates inside a collective beside its output, on two CPU ranks (the estimator's rank traces add it).

    .venv/bin/python bench/research/gloo_buffers.py [--out bench/results/archive/gloo-buffers.json]

Each collective runs once on a 1 MiB fp32 input under the profiler; the live-bytes peak over the call, less its input
(alive before) and its output, is the buffer gloo held inside it, here as a multiple of the output's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
N = 1 << 18  # elements: 1 MiB of fp32


def rank_main(rank: int, port: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(ROOT))
    from advisor.measure import replay_memory_events

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x, group = torch.randn(N), dist.group.WORLD

    def gather() -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_gather_tensor(x, 0, group))

    def gather_base() -> torch.Tensor:
        out = torch.empty(2 * N)
        dist.all_gather_into_tensor(out, x)
        return out

    def scatter() -> torch.Tensor:
        return funcol.wait_tensor(funcol.reduce_scatter_tensor(x, "sum", 0, group))

    def reduce() -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))

    rows = {}
    for name, fn in (("all_gather (functional)", gather), ("all_gather_into_tensor (c10d)", gather_base),
                     ("reduce_scatter (functional)", scatter), ("all_reduce (functional)", reduce)):
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = fn()
            out_bytes = result.nbytes
            del result
        peak, _ = replay_memory_events(prof)
        rows[name] = {"output_bytes": out_bytes, "peak_bytes": peak, "held_over_output": (peak - out_bytes) / out_bytes}
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows, indent=1))
        for name, r in rows.items():
            print(f"{name:32s} held beside the output: {r['held_over_output']:.2f} x its bytes")
    os._exit(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench/results/archive/gloo-buffers.json"))
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.port, args.out)
    sys.path.insert(0, str(ROOT))
    from advisor.parallel.measure import free_port

    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", port, "--out", args.out])
             for r in range(2)]
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())

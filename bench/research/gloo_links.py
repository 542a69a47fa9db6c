"""gloo's all-reduce over loopback on this machine: its bus bandwidth on large tensors and its latency on a 4-byte
one, behind the `cpu` catalog entry's intra-node link figures (advisor/hardware/catalog.py).

    .venv/bin/python bench/research/gloo_links.py [--ranks 2] [--out bench/results/archive/gloo_links.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

SIZES = (4, 1 << 20, 16 << 20, 64 << 20)  # bytes


def _rank(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for nbytes in SIZES:
        t = torch.ones(nbytes // 4)
        for _ in range(3):
            dist.all_reduce(t)
        n = 200 if nbytes < 1 << 20 else 10
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(t)
        dt = (time.perf_counter() - t0) / n
        # a ring all-reduce moves 2 (n - 1) / n of the buffer over each rank's link
        rows.append({"bytes": nbytes, "seconds": dt, "bus_gbps": nbytes * 2 * (world - 1) / world / dt / 1e9})
    if rank == 0:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"ranks": world, "cpu": platform.processor() or platform.machine(),
                                         "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                                         "all_reduce": rows}, indent=1))
        for r in rows:
            print(f"{r['bytes']:>10} B  {r['seconds'] * 1e6:10.1f} us  bus {r['bus_gbps']:6.2f} GB/s")
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results/archive/gloo_links.json"))
    args = ap.parse_args()
    mp.spawn(_rank, args=(args.ranks, args.port, args.out), nprocs=args.ranks)


if __name__ == "__main__":
    main()

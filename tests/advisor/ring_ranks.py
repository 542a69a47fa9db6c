"""Two gloo ranks run ring attention (advisor/parallel/context.py) on their shares of one sequence and print, per rank,
the largest difference of its output and of the gradients of q, k and v from causal SDPA over the whole sequence
(grouped-query: 4 query heads, 2 key/value heads). Run by tests/advisor/test_layouts.py."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F


def _rank(rank: int, world: int, port: int, out: str) -> None:
    from advisor.parallel.context import ContextShard, ring_attention

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 16, 8, requires_grad=True) for _ in range(2))
    whole = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    grad = torch.randn_like(whole)
    whole.backward(grad)
    shard = ContextShard(dist.group.WORLD, rank, world, 16)
    mine = [shard.shard(x.detach(), 2).requires_grad_() for x in (q, k, v)]
    ring = ring_attention(*mine, shard)
    ring.backward(shard.shard(grad, 2))
    pairs = [(ring, whole.detach())] + [(m.grad, x.grad) for m, x in zip(mine, (q, k, v))]
    errors = [(a - shard.shard(b, 2)).abs().max().item() for a, b in pairs]
    dist.barrier()
    dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        f.write(" ".join(map(str, errors)))


if __name__ == "__main__":
    import tempfile

    from advisor.parallel.measure import free_port

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "errors")
        mp.spawn(_rank, args=(2, free_port(), path), nprocs=2)
        print(" ".join(open(f"{path}.{r}").read() for r in range(2)))

"""Two gloo ranks run ring attention (advisor/parallel/context.py) on their shares of one sequence and print, per rank,
the largest difference of its output and of the gradients of q, k and v from causal SDPA over the whole sequence
(grouped-query: 4 query heads, 2 key/value heads). Run by tests/advisor/test_layouts.py."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def errors(rank: int, world: int) -> str:
    from advisor.parallel.context import ContextShard, ring_attention

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
    return " ".join(str((a - shard.shard(b, 2)).abs().max().item()) for a, b in pairs)


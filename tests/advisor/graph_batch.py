"""A message-passing graph network over a batch of graphs of varying size, for the tests: its make_batch
reads values (the node-to-graph index is repeat_interleave of the graphs' sizes, a data-dependent output
shape fake tensors refuse), while its model runs on fake tensors (gathers and index_add_ by index tensors)."""

import torch
import torch.nn.functional as F
from torch import nn

from advisor import Workload


class _Net(nn.Module):
    def __init__(self, feats: int, d: int, classes: int) -> None:
        super().__init__()
        self.inp = nn.Linear(feats, d)
        self.msg = nn.Linear(2 * d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x, src, dst, graph, graphs):
        h = F.silu(self.inp(x))
        h = h + torch.zeros_like(h).index_add_(0, dst, F.silu(self.msg(torch.cat([h[src], h[dst]], -1))))
        pooled = torch.zeros(graphs, h.shape[1], dtype=h.dtype).index_add_(0, graph, h)
        return self.head(pooled)


def build(feats: int = 16, d: int = 64, classes: int = 5, nodes_per_graph: int = 30, degree: int = 4,
          vary_sizes: bool = False) -> Workload:
    """`vary_sizes`: graphs of 1/2 to 3/2 of `nodes_per_graph` nodes, drawn at random, so a batch's node count
    is not proportional to its size; else all of `nodes_per_graph`."""

    def make_batch(n):
        g = torch.Generator().manual_seed(0)
        sizes = torch.randint(nodes_per_graph // 2, nodes_per_graph * 3 // 2 + 1, (n,), generator=g) if vary_sizes \
            else torch.full((n,), nodes_per_graph)
        graph = torch.repeat_interleave(torch.arange(n), sizes)
        nodes = int(sizes.sum())
        src = torch.arange(nodes).repeat_interleave(degree)
        local = (torch.rand(nodes * degree, generator=g) * sizes[graph].repeat_interleave(degree)).long()
        dst = (torch.cumsum(sizes, 0) - sizes)[graph].repeat_interleave(degree) + local
        return torch.randn(nodes, feats, generator=g), src, dst, graph, torch.randint(0, classes, (n,), generator=g)

    def loss_fn(model, batch):
        x, src, dst, graph, y = batch
        return F.cross_entropy(model(x, src, dst, graph, y.shape[0]), y)

    return Workload(name="graph-batch", build_model=lambda: _Net(feats, d, classes), make_batch=make_batch,
                    loss_fn=loss_fn, default_batch_size=32)

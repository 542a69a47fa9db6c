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


def build(feats: int = 16, d: int = 64, classes: int = 5, nodes_per_graph: int = 30, degree: int = 4) -> Workload:
    def make_batch(n):
        g = torch.Generator().manual_seed(0)
        sizes = torch.full((n,), nodes_per_graph)  # equal sizes: the node count grows in step with the batch
        graph = torch.repeat_interleave(torch.arange(n), sizes)
        nodes = n * nodes_per_graph
        src = torch.arange(nodes).repeat_interleave(degree)
        dst = graph.repeat_interleave(degree) * nodes_per_graph + torch.randint(0, nodes_per_graph, (nodes * degree,),
                                                                                generator=g)
        return torch.randn(nodes, feats, generator=g), src, dst, graph, torch.randint(0, classes, (n,), generator=g)

    def loss_fn(model, batch):
        x, src, dst, graph, y = batch
        return F.cross_entropy(model(x, src, dst, graph, y.shape[0]), y)

    return Workload(name="graph-batch", build_model=lambda: _Net(feats, d, classes), make_batch=make_batch,
                    loss_fn=loss_fn, default_batch_size=32)

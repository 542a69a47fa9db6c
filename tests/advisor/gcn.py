"""A two-layer graph convolutional network on a sparse COO adjacency (torch.sparse.mm) for the tests: each
sample is 40 nodes of 6 random edges each, so the adjacency's entries grow with the batch."""

import torch
import torch.nn.functional as F
from torch import nn

from advisor import Workload


class GCN(nn.Module):
    def __init__(self, features: int = 32, hidden: int = 64, classes: int = 5):
        super().__init__()
        self.l1, self.l2 = nn.Linear(features, hidden), nn.Linear(hidden, classes)

    def forward(self, adj, x):
        return torch.sparse.mm(adj, self.l2(F.relu(torch.sparse.mm(adj, self.l1(x)))))


def make_batch(n: int, features: int = 32):
    g = torch.Generator().manual_seed(0)
    nodes = 40 * n
    edges = torch.randint(0, nodes, (2, 6 * nodes), generator=g)
    adj = torch.sparse_coo_tensor(edges, torch.rand(edges.shape[1], generator=g), (nodes, nodes),
                                  check_invariants=False).coalesce()
    return adj, torch.randn(nodes, features, generator=g), torch.randint(0, 5, (nodes,), generator=g)


def build(hidden: int = 64):
    return Workload(name="gcn", build_model=lambda: GCN(hidden=hidden), make_batch=make_batch,
                    loss_fn=lambda m, b: F.cross_entropy(m(b[0], b[1]), b[2]))

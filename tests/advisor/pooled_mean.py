"""Set pooling by a mean over a wide activation, for the tests: under bf16 autocast the activation is bf16, and
the CPU's mean over a 16-bit input sums a float32 copy of it (twice its bytes) inside the kernel, where no
dispatch mode sees it, fake or real."""

import torch
import torch.nn.functional as F
from torch import nn

from advisor import Workload


class _Pool(nn.Module):
    def __init__(self, features: int, width: int, classes: int) -> None:
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.inp(x).mean(dim=1))


def build(points: int = 512, features: int = 32, width: int = 512, classes: int = 10) -> Workload:
    def make_batch(n):
        g = torch.Generator().manual_seed(0)
        return torch.randn(n, points, features, generator=g), torch.randint(0, classes, (n,), generator=g)

    return Workload(name="pooled-mean", build_model=lambda: _Pool(features, width, classes), make_batch=make_batch,
                    loss_fn=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]), default_batch_size=8)

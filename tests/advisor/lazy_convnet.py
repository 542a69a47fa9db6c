"""A convolutional net of lazy modules for the tests: LazyConv2d, LazyBatchNorm2d (lazy buffers too) and LazyLinear,
every shape inferred from the first input."""

import torch
import torch.nn.functional as F
from torch import nn

from advisor import Workload


def build():
    def model():
        return nn.Sequential(nn.LazyConv2d(16, 3, padding=1), nn.LazyBatchNorm2d(), nn.ReLU(), nn.MaxPool2d(2),
                             nn.LazyConv2d(32, 3, padding=1), nn.LazyBatchNorm2d(), nn.ReLU(), nn.Flatten(),
                             nn.LazyLinear(10))
    return Workload(name="lazy-conv", build_model=model,
                    make_batch=lambda n: (torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))),
                    loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))

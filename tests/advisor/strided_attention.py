"""A workload for tests/advisor/test_trace.py: attention written with einsum over (batch, channels,
positions), as diffusion U-Nets write it, so softmax's backward receives the transposed gradient of
the product after it and its CPU kernel copies that gradient to a contiguous buffer inside itself."""

import torch
import torch.nn.functional as F
from torch import nn

from advisor import Workload


class _Attention(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.qkv = nn.Conv1d(channels, 3 * channels, 1)
        self.out = nn.Conv1d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=1)
        a = torch.einsum("bci,bcj->bij", q, k).mul(x.shape[1] ** -0.5).softmax(-1)
        return x + self.out(torch.einsum("bij,bcj->bci", a, v))


def build(batch_size: int = 4, channels: int = 16, positions: int = 1024) -> Workload:
    def make_batch(n: int):
        g = torch.Generator().manual_seed(0)
        return torch.randn(n, channels, positions, generator=g), torch.randn(n, channels, positions, generator=g)

    return Workload(name="strided-attention", build_model=lambda: _Attention(channels), make_batch=make_batch,
                    loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]), default_batch_size=batch_size)

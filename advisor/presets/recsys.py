"""Recommender preset: DLRM (Naumov et al. 2019) and tiny-dlrm.

Sparse features go through sum-pooled embedding tables, dense features through a bottom MLP;
all pairwise dot products of those vectors feed a top MLP that predicts a click (BCE loss).
Real tables hold up to billions of rows; the default here is 8 x 1M x 64 (512M params, 2 GiB fp32).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from advisor.presets._util import check_positive, generator
from advisor.presets.data import ClickDataset
from advisor.workload import Workload

DENSE_FEATURES = 13  # Criteo's integer features


def _mlp(widths: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """forward(dense (B, D), sparse (B, tables, pooling) int64) -> click logits (B,)."""

    def __init__(self, tables: int, rows: int, dim: int, bottom: list[int], top: list[int]) -> None:
        super().__init__()
        self.embeddings = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(tables))
        self.bottom = _mlp([DENSE_FEATURES, *bottom, dim], last_relu=True)
        vectors = tables + 1  # one per table plus the bottom-MLP output
        self.top = _mlp([dim + vectors * (vectors - 1) // 2, *top, 1], last_relu=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)  # (B, dim)
        pooled = [table(sparse[:, i]) for i, table in enumerate(self.embeddings)]  # each (B, dim)
        vecs = torch.stack([x, *pooled], dim=1)  # (B, vectors, dim)
        # Strict upper triangle of the (vectors x vectors) dot-product matrix: each pair once.
        # Indices are made per call, not kept as a buffer, so meta-device / FSDP init has nothing to restore.
        rows, cols = torch.triu_indices(vecs.shape[1], vecs.shape[1], offset=1, device=vecs.device)
        dots = torch.bmm(vecs, vecs.transpose(1, 2))[:, rows, cols]  # (B, pairs)
        return self.top(torch.cat((x, dots), dim=1)).squeeze(1)


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    dense, sparse, labels = batch
    return F.binary_cross_entropy_with_logits(model(dense, sparse).float(), labels)


def _dlrm(name: str, *, batch_size: int, tables: int, rows: int, dim: int, pooling: int, bottom: list[int],
          top: list[int], num_samples: int, seed: int) -> Workload:
    check_positive(name, batch_size=batch_size, tables=tables, rows=rows, dim=dim, pooling=pooling,
                   num_samples=num_samples)

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = generator(seed)
        dense = torch.rand(n, DENSE_FEATURES, generator=g)
        sparse = torch.randint(0, rows, (n, tables, pooling), generator=g)
        return dense, sparse, (torch.rand(n, generator=g) < 0.25).float()

    return Workload(
        name=name,
        build_model=lambda: DLRM(tables, rows, dim, bottom, top),
        make_batch=make_batch,
        loss_fn=_loss,
        dataset=lambda: ClickDataset(num_samples, DENSE_FEATURES, tables, rows, pooling, seed),
        default_batch_size=batch_size,
        embedding_heavy=True,
    )


def dlrm(*, batch_size: int = 2048, tables: int = 8, rows: int = 1_000_000, dim: int = 64, pooling: int = 1,
         num_samples: int = 100_000, seed: int = 0) -> Workload:
    """DLRM, Criteo-style MLPs (bottom 13-512-256-dim, top 512-256-1); `rows` per table, `pooling` ids per bag."""
    return _dlrm("dlrm", batch_size=batch_size, tables=tables, rows=rows, dim=dim, pooling=pooling,
                 bottom=[512, 256], top=[512, 256], num_samples=num_samples, seed=seed)


def tiny_dlrm(*, batch_size: int = 8, tables: int = 4, rows: int = 10_000, dim: int = 16, pooling: int = 2,
              num_samples: int = 256, seed: int = 0) -> Workload:
    """4 tables x 10k rows x 16 dim, 64-wide MLPs (~0.65M params)."""
    return _dlrm("tiny-dlrm", batch_size=batch_size, tables=tables, rows=rows, dim=dim, pooling=pooling,
                 bottom=[64], top=[64], num_samples=num_samples, seed=seed)

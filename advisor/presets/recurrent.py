"""Recurrent preset: an LSTM word-level language model (Zaremba et al. 2014 style) and tiny-lstm."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from advisor.presets._util import check_positive, generator, token_cross_entropy
from advisor.presets.data import TokenDataset
from advisor.workload import Workload


class LSTMLanguageModel(nn.Module):
    """Embedding -> `layers`-layer nn.LSTM -> vocab head. forward(idx (B, T)) -> logits (B, T, V)."""

    def __init__(self, vocab: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embedding(idx))  # zero initial state: samples are independent windows
        return self.head(out)


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, targets = batch
    return token_cross_entropy(model(inputs), targets)


def _lstm(name: str, *, batch_size: int, seq_len: int, vocab: int, hidden: int, layers: int,
          num_samples: int, seed: int) -> Workload:
    check_positive(name, batch_size=batch_size, seq_len=seq_len, vocab=vocab, hidden=hidden, layers=layers,
                   num_samples=num_samples)

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.randint(0, vocab, (n, seq_len + 1), generator=generator(seed))
        return window[:, :-1], window[:, 1:]

    return Workload(
        name=name,
        build_model=lambda: LSTMLanguageModel(vocab, hidden, layers),
        make_batch=make_batch,
        loss_fn=_loss,
        dataset=lambda: TokenDataset(num_samples, seq_len, vocab, seed),
        tokens_per_sample=seq_len,
        default_batch_size=batch_size,
    )


def lstm(*, batch_size: int = 64, seq_len: int = 64, vocab: int = 10_000, hidden: int = 1024, layers: int = 2,
         num_samples: int = 10_000, seed: int = 0) -> Workload:
    """2 x 1024 LSTM over a 10k vocabulary (Penn Treebank size), ~37.3M params."""
    return _lstm("lstm", batch_size=batch_size, seq_len=seq_len, vocab=vocab, hidden=hidden, layers=layers,
                 num_samples=num_samples, seed=seed)


def tiny_lstm(*, batch_size: int = 4, seq_len: int = 16, vocab: int = 512, hidden: int = 128, layers: int = 2,
              num_samples: int = 64, seed: int = 0) -> Workload:
    """2 x 128 LSTM over 512 tokens (~0.4M params)."""
    return _lstm("tiny-lstm", batch_size=batch_size, seq_len=seq_len, vocab=vocab, hidden=hidden, layers=layers,
                 num_samples=num_samples, seed=seed)

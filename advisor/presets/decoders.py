"""Decoder-only language models for the gpt2-* and llama-* presets.

Both keep their repeated blocks in `self.blocks` (an nn.ModuleList): the estimator and the
FSDP / activation-checkpointing wrappers look for it. forward(idx (B, T) int64) -> logits (B, T, V).
"""

from __future__ import annotations

import torch
from torch import nn

from advisor.presets.layers import LlamaBlock, TransformerBlock, init_normal, rope_tables


class GPT2(nn.Module):
    """GPT-2 (Radford et al. 2019): learned positions, pre-LayerNorm, GELU MLP, LM head tied to wte."""

    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, seq_len: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq_len, hidden)  # one learned vector per position up to seq_len
        self.blocks = nn.ModuleList(
            TransformerBlock(hidden, heads, 4 * hidden, causal=True, pre_norm=True, gelu="tanh")
            for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.apply(init_normal)
        self.lm_head.weight = self.wte.weight  # tied: counted once by parameters()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class Llama(nn.Module):
    """Llama 2/3 (Touvron et al. 2023): RMSNorm, SwiGLU, grouped-query attention, RoPE, no biases."""

    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, ffn_hidden: int, vocab: int,
                 tied_embeddings: bool = False, rope_theta: float = 500_000.0) -> None:
        super().__init__()
        self.head_dim, self.rope_theta = hidden // heads, rope_theta  # Llama 3 uses theta = 500k
        self.tok_embeddings = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(LlamaBlock(hidden, heads, kv_heads, ffn_hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.output = nn.Linear(hidden, vocab, bias=False)
        self.apply(init_normal)
        if tied_embeddings:  # Llama 3.2 1B/3B tie the output projection to the embedding
            self.output.weight = self.tok_embeddings.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_tables(idx.shape[1], self.head_dim, self.rope_theta, idx.device)  # (T, D) each
        x = self.tok_embeddings(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.output(self.norm(x))

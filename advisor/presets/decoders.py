"""One decoder-only language model for every decoder preset (gpt2-*, llama-*, decoder), built from a DecoderArch.

The repeated blocks live in `self.blocks` (an nn.ModuleList): the estimator and the FSDP / activation-
checkpointing wrappers look for it. Pipeline stages call `embed`, `rope`, the blocks and `head` one by one;
tensor parallelism shards `wq`/`wk`/`wv` by rows and `wo` by columns, so attention reads its head counts
from the tensors. Shapes: B batch, T tokens, C hidden, H query heads, KV key/value heads, D head dim, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from advisor.presets.layers import MLP, SwiGLU, apply_rope, init_normal, rope_tables
from advisor.workload import DecoderArch

Rope = tuple[torch.Tensor, torch.Tensor] | None  # (cos, sin), each (T, D); None with learned positions


class Attention(nn.Module):
    """Causal self-attention with separate q, k, v projections; H query heads share KV heads in groups of H / KV.

    forward takes the head counts from wq's and wk's output widths, so a module whose projections hold a
    slice of the heads (H/tp query heads and KV/tp key/value heads, wo's matching input columns) computes
    that slice's share of the output.
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int, bias: bool) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.wq = nn.Linear(hidden, heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(heads * self.head_dim, hidden, bias=bias)
        self.context = None  # a ContextShard under context parallel (advisor/parallel/context.py): ring attention

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.context is not None:
            from advisor.parallel.context import ring_attention

            y = ring_attention(q, k, v, self.context)
            return self.wo(y.transpose(1, 2).reshape(b, t, -1))
        group = q.shape[1] // k.shape[1]
        if group > 1:  # expand KV to H heads (as Meta's reference and torchtitan do): every SDPA backend takes it
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


def _norm(arch: DecoderArch) -> nn.Module:
    return nn.RMSNorm(arch.hidden, eps=1e-5) if arch.norm == "rmsnorm" else nn.LayerNorm(arch.hidden, eps=1e-5)


class DecoderBlock(nn.Module):
    """Pre-norm block: x + attn(attn_norm(x), rope), then x + ffn(ffn_norm(x))."""

    def __init__(self, arch: DecoderArch) -> None:
        super().__init__()
        self.attn_norm = _norm(arch)
        self.attn = Attention(arch.hidden, arch.heads, arch.kv_heads, arch.bias)
        self.ffn_norm = _norm(arch)
        # SwiGLU has no biases (Llama); the GELU MLP follows `bias` (GPT-2: biases everywhere)
        self.ffn = (SwiGLU(arch.hidden, arch.ffn_hidden) if arch.gated_ffn
                    else MLP(arch.hidden, arch.ffn_hidden, gelu="tanh", bias=arch.bias))

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.ffn(self.ffn_norm(x))


class Decoder(nn.Module):
    """Decoder-only LM: forward(idx (B, T) int64) -> logits (B, T, V) = head(blocks(embed(idx), rope)).

    GPT-2 (Radford et al. 2019) is learned positions, LayerNorm, GELU MLP, biases and a tied head; Llama 3
    (Touvron et al. 2023) is RoPE, RMSNorm, SwiGLU, grouped-query attention and no biases.
    """

    def __init__(self, arch: DecoderArch) -> None:
        super().__init__()
        self.arch = arch
        self.tok_embeddings = nn.Embedding(arch.vocab, arch.hidden)
        # one learned vector per position up to seq_len (GPT-2); RoPE rotates q and k instead
        self.pos_embeddings = nn.Embedding(arch.seq_len, arch.hidden) if arch.learned_positions else None
        self.blocks = nn.ModuleList(DecoderBlock(arch) for _ in range(arch.layers))
        self.norm = _norm(arch)
        self.output = nn.Linear(arch.hidden, arch.vocab, bias=False)
        self.context = None  # a ContextShard under context parallel: idx holds its rank's tokens only
        self.init_weights()

    def init_weights(self) -> None:
        """N(0, 0.02) weights, zero biases, unit norms; ties `output` to the token embedding again.

        Re-tying matters after `to_empty()`: it gives each module its own new tensor, which unties them.
        """
        if self.arch.tied_embeddings:  # one tensor, counted once by parameters()
            self.output.weight = self.tok_embeddings.weight
        for module in self.modules():
            init_normal(module)
            if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.reset_parameters()

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token embeddings of idx (B, T), plus learned positions where the model has them: (B, T, C)."""
        x = self.tok_embeddings(idx)
        if self.pos_embeddings is not None:
            x = x + self.pos_embeddings(self._positions(idx.shape[1], idx.device))
        return x

    def _positions(self, seq_len: int, device: torch.device | str) -> torch.Tensor:
        """The positions of the `seq_len` tokens this rank holds: 0..seq_len-1, or its context-parallel share."""
        if self.context is None:
            return torch.arange(seq_len, device=device)
        return self.context.positions(device)

    def rope(self, seq_len: int, device: torch.device | str) -> Rope:
        """RoPE (cos, sin) tables for the `seq_len` tokens this rank holds, each (T, D) fp32; None with learned
        positions."""
        if self.pos_embeddings is not None:
            return None
        device = torch.device(device)
        where = None if self.context is None else self._positions(seq_len, device)
        return rope_tables(seq_len, self.arch.hidden // self.arch.heads, self.arch.rope_theta, device, where)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and output projection: (B, T, C) -> logits (B, T, V)."""
        return self.output(self.norm(x))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        rope = self.rope(idx.shape[1], idx.device)
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, rope)
        return self.head(x)

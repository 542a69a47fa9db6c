"""Transformer building blocks shared by the presets: BERT and ViT blocks (LayerNorm, fused QKV, GELU MLP),
and the GELU MLP, SwiGLU and RoPE that the decoder (advisor/presets/decoders.py) builds from.

Attention always goes through `F.scaled_dot_product_attention`, so flash / memory-efficient
kernels apply on GPU. Shapes: B batch, T tokens, C hidden, H heads, D = C / H head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    """Multi-head self-attention with a fused QKV projection (BERT / ViT layout)."""

    def __init__(self, hidden: int, heads: int, causal: bool, bias: bool = True) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.proj = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # (B, T, 3C) -> 3 x (B, H, T, D)
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    """Two-matrix feed-forward: Linear(C, F) -> GELU -> Linear(F, C)."""

    def __init__(self, hidden: int, ffn_hidden: int, gelu: str = "none", bias: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, ffn_hidden, bias=bias)
        self.act = nn.GELU(approximate=gelu)  # GPT-2 uses the tanh approximation, BERT/ViT the exact erf
        self.proj = nn.Linear(ffn_hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class TransformerBlock(nn.Module):
    """LayerNorm block. pre_norm=True: x + f(LN(x)) (ViT); False: LN(x + f(x)) (BERT)."""

    def __init__(self, hidden: int, heads: int, ffn_hidden: int, *, causal: bool, pre_norm: bool,
                 gelu: str = "none", eps: float = 1e-5) -> None:
        super().__init__()
        self.pre_norm = pre_norm
        self.ln1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = SelfAttention(hidden, heads, causal)
        self.ln2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = MLP(hidden, ffn_hidden, gelu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cos/sin tables, each (T, D), in the rotate-half layout (Su et al. 2021; HF Llama), for positions
    0..seq_len-1 or the given `positions` (T of them).

    Computed per forward rather than stored as a buffer: it costs T x D flops and leaves nothing
    to re-initialise after meta-device or FSDP construction.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    where = torch.arange(seq_len, device=device) if positions is None else positions
    angles = torch.outer(where.to(torch.float32), inv_freq)  # (T, D/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, D)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, D) queries or keys by position."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class SwiGLU(nn.Module):
    """Gated feed-forward (Shazeer 2020): w2(silu(w1 x) * w3 x); three C x F matrices."""

    def __init__(self, hidden: int, ffn_hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn_hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn_hidden, bias=False)
        self.w2 = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def init_normal(module: nn.Module, std: float = 0.02) -> None:
    """GPT-2 / BERT initialisation: N(0, std) for Linear and Embedding weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=std)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)

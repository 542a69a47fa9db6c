"""Context parallel: the sequence split across cp ranks, attention's keys and values passed around them in a ring.

The sequence is cut into 2 x cp chunks; rank r holds chunks r and 2cp-1-r (an early one and a late one), so that
causal attention's work is even across the ring, as torch's head-tail load balancer places them. Attention runs
torch's templated ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers"): each of cp steps
attends the local queries to one rank's keys and values while the next block arrives from the previous rank,
partial results merged by their log-sum-exp; backward passes keys and values around again, with their gradients
travelling beside them back to their owner. Only the kernels are per device: torch's ring attention dispatches
CUDA kernels only, so the CPU's flash kernel and its backward are given to it here.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

SEQ_DIM = 2  # attention's tensors are (batch, heads, tokens, head_dim)


@dataclass(frozen=True)
class ContextShard:
    """Rank `rank` of `size` context-parallel ranks over `group`, for sequences of `seq_len` tokens."""

    group: Any
    rank: int
    size: int
    seq_len: int

    @property
    def chunk(self) -> int:
        return self.seq_len // (2 * self.size)

    def spans(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """The two [start, end) token ranges this rank holds, in order."""
        c, r = self.chunk, self.rank
        return (r * c, (r + 1) * c), ((2 * self.size - 1 - r) * c, (2 * self.size - r) * c)

    def positions(self, device: Any = None) -> torch.Tensor:
        """This rank's token positions in the whole sequence (seq_len / cp of them), int64."""
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.spans()])

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of `x`, whose dimension `dim` is the whole sequence."""
        return torch.cat([x.narrow(dim, a, b - a) for a, b in self.spans()], dim=dim)


def apply_context_parallel(model: nn.Module, shard: ContextShard) -> None:
    """Point `model` (a decoder, or a pipeline stage of one: advisor/presets/decoders.py) at `shard`: it then embeds,
    rotates and attends this rank's tokens, and attention runs the ring."""
    for module in model.modules():
        if hasattr(module, "context"):
            module.context = shard
    decoder = getattr(model, "_decoder", None)  # a pipeline stage reaches its decoder's embed and rope through this
    if decoder is not None:
        decoder.context = shard


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """Causal attention of this rank's queries (B, H, T/cp, D) over the whole sequence's keys and values, held
    (B, KV, T/cp, D) by the ring's ranks: (B, H, T/cp, D). KV may divide H (grouped-query attention): the blocks
    travel with KV heads and are expanded only for the kernel."""
    return _RingAttention.apply(q, k, v, shard)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: ContextShard) -> torch.Tensor:
        from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

        with _ring_options():
            out, lse = _templated_ring_attention(shard.group, SEQ_DIM, _forward_op(q), q, k, v, is_causal=True)[:2]
        # held token-major, as SDPA's kernels leave their output: the caller's (B, T, H x D) view of it copies nothing
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.shard = shard
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _templated_ring_attention_backward,
        )

        q, k, v, out, lse = ctx.saved_tensors
        with _ring_options():
            dq, dk, dv = _templated_ring_attention_backward(
                ctx.shard.group, SEQ_DIM, _backward_op(q), grad_out.contiguous(), "grad_out", q, k, v, out, lse,
                is_causal=True)[:3]
        return dq, dk, dv, None


@contextlib.contextmanager
def _ring_options() -> Iterator[None]:
    """Ring rotation (point to point, not one all-gather of every block) with head-tail load balance, for the call
    only: torch keeps these options in one process-wide object."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    saved = (cp._cp_options.rotate_method, cp._cp_options.enable_load_balance)
    cp._cp_options.rotate_method, cp._cp_options.enable_load_balance = cp._RotateMethod.ALL_TO_ALL, True
    try:
        yield
    finally:
        cp._cp_options.rotate_method, cp._cp_options.enable_load_balance = saved


def _expand(k: torch.Tensor, heads: int) -> torch.Tensor:
    group = heads // k.shape[1]
    return k.repeat_interleave(group, dim=1) if group > 1 else k


def _fold(dk: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of `_expand`: each KV head's share summed over the query heads it served."""
    b, h, t, d = dk.shape
    return dk if h == kv_heads else dk.view(b, kv_heads, h // kv_heads, t, d).sum(dim=2)


def _forward_op(q: torch.Tensor) -> Any:
    """One block's attention: (out, logsumexp) from the device's kernel."""
    aten = torch.ops.aten
    cuda = q.device.type == "cuda"
    flash = cuda and q.dtype in (torch.float16, torch.bfloat16)

    def op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool) -> tuple:
        key, value = _expand(key, query.shape[1]), _expand(value, query.shape[1])
        if not cuda:
            return aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal)
        if flash:
            return aten._scaled_dot_product_flash_attention(query, key, value, 0.0, is_causal)[:2]
        out, lse = aten._scaled_dot_product_efficient_attention(query, key, value, None, True, 0.0, is_causal)[:2]
        return out, lse[..., :query.shape[2]]  # the kernel pads its logsumexp's tokens to a multiple of 32

    return op


def _backward_op(q: torch.Tensor) -> Any:
    """One block's attention gradients (dq, dk, dv), dk and dv folded back to the block's KV heads."""
    aten = torch.ops.aten
    cuda = q.device.type == "cuda"
    flash = cuda and q.dtype in (torch.float16, torch.bfloat16)

    def op(*, grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           out: torch.Tensor, logsumexp: torch.Tensor, is_causal: bool) -> tuple:
        kv_heads = key.shape[1]
        key, value = _expand(key, query.shape[1]), _expand(value, query.shape[1])
        if not cuda:
            dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out, query, key, value, out, logsumexp, 0.0, is_causal)
        elif flash:
            zero = torch.zeros((), dtype=torch.int64, device=q.device)
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                grad_out, query, key, value, out, logsumexp, None, None, query.shape[2], key.shape[2], 0.0,
                is_causal, zero, zero)
        else:
            zero = torch.zeros((), dtype=torch.int64, device=q.device)
            dq, dk, dv = aten._scaled_dot_product_efficient_attention_backward(
                grad_out, query, key, value, None, out, logsumexp.contiguous(), zero, zero, 0.0,
                (True, True, True, False), is_causal)[:3]
        return dq, _fold(dk, kv_heads), _fold(dv, kv_heads)

    return op

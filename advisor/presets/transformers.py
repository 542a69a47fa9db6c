"""Language-model presets: decoder (any shape from its arguments), bert-base, gpt2-small|medium|large|xl,
llama-1b|8b|70b and tiny-* variants.

Every decoder preset is one Decoder (advisor/presets/decoders.py) built from a DecoderArch, which also
drives the analytic memory estimator; `seq_len` (tokens per sample) may be shorter than the model's real context.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from advisor.errors import SpecError
from advisor.presets._util import check_divisible, check_positive, generator, token_cross_entropy
from advisor.presets.data import MaskedLMDataset, TokenDataset, mask_tokens
from advisor.presets.decoders import Decoder
from advisor.presets.encoders import BertMLM
from advisor.workload import DecoderArch, Workload

GPT2_VOCAB = 50257
LLAMA3_VOCAB = 128256
BERT_VOCAB = 30522  # WordPiece, uncased
MLPS, NORMS, POSITIONS = ("swiglu", "gelu"), ("rmsnorm", "layernorm"), ("rope", "learned")


def _lm_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, targets = batch  # (B, T) int64 each
    return token_cross_entropy(model(inputs), targets)


def decoder(*, layers: int, hidden: int, heads: int, kv_heads: int | None = None, ffn: int | None = None,
            vocab: int = 32000, seq_len: int = 2048, mlp: str = "swiglu", norm: str = "rmsnorm",
            tie_embeddings: bool = False, positions: str = "rope", bias: bool = False, batch_size: int = 8,
            num_samples: int = 10_000, seed: int = 0) -> Workload:
    """Any decoder-only LM: layers, hidden, heads / kv_heads (GQA), ffn, mlp (swiglu|gelu), norm, positions.

    kv_heads defaults to heads; ffn to 4 x hidden for gelu and to Llama's rule for swiglu
    (8/3 x hidden rounded up to a multiple of 256). Bad arguments raise SpecError.
    """
    return _decoder("decoder", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab,
                    seq_len=seq_len, mlp=mlp, norm=norm, tie_embeddings=tie_embeddings, positions=positions,
                    bias=bias, batch_size=batch_size, num_samples=num_samples, seed=seed)


def tiny_decoder(*, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int | None = 2,
                 ffn: int | None = None, vocab: int = 512, seq_len: int = 32, mlp: str = "swiglu",
                 norm: str = "rmsnorm", tie_embeddings: bool = False, positions: str = "rope", bias: bool = False,
                 batch_size: int = 2, num_samples: int = 64, seed: int = 0) -> Workload:
    """The decoder preset at 2 layers, 64 wide, 4 heads / 2 KV, vocab 512 (~0.2M params); same arguments."""
    return _decoder("tiny-decoder", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn,
                    vocab=vocab, seq_len=seq_len, mlp=mlp, norm=norm, tie_embeddings=tie_embeddings,
                    positions=positions, bias=bias, batch_size=batch_size, num_samples=num_samples, seed=seed)


def _decoder(name: str, *, layers: int, hidden: int, heads: int, kv_heads: int | None, ffn: int | None, vocab: int,
             seq_len: int, mlp: str, norm: str, tie_embeddings: bool, positions: str, bias: bool, batch_size: int,
             num_samples: int, seed: int) -> Workload:
    """Check the arguments (values from a command line may have any JSON type) and build the workload."""
    kv_heads = heads if kv_heads is None else kv_heads
    sizes = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab, seq_len=seq_len)
    _check_sizes(name, **sizes, **({} if ffn is None else {"ffn": ffn}), batch_size=batch_size,
                 num_samples=num_samples)
    check_divisible(name, "hidden", hidden, heads, "heads")
    check_divisible(name, "heads", heads, kv_heads, "kv_heads")
    for key, value, allowed in (("mlp", mlp, MLPS), ("norm", norm, NORMS), ("positions", positions, POSITIONS)):
        if value not in allowed:
            raise SpecError(f"preset {name!r}: {key} must be one of {', '.join(allowed)}, got {value!r}")
    for key, value in (("tie_embeddings", tie_embeddings), ("bias", bias)):
        if not isinstance(value, bool):
            raise SpecError(f"preset {name!r}: {key} must be true or false, got {value!r}")
    if ffn is None:  # Llama's rule keeps SwiGLU's three matrices near the parameters of a 4x GELU MLP
        ffn = 4 * hidden if mlp == "gelu" else 256 * math.ceil(int(8 * hidden / 3) / 256)
    arch = DecoderArch(**sizes, ffn_hidden=ffn, gated_ffn=mlp == "swiglu", norm=norm, tied_embeddings=tie_embeddings,
                       learned_positions=positions == "learned", bias=bias)
    return _decoder_workload(name, arch, batch_size=batch_size, num_samples=num_samples, seed=seed)


def _check_sizes(name: str, **sizes: object) -> None:
    """SpecError naming the first size that is not a positive integer."""
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise SpecError(f"preset {name!r}: {key} must be a positive integer, got {value!r}")


def _decoder_workload(name: str, arch: DecoderArch, *, batch_size: int, num_samples: int, seed: int) -> Workload:
    """Next-token prediction on uniform random tokens: batch = (inputs (B, T), targets (B, T))."""

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.randint(0, arch.vocab, (n, arch.seq_len + 1), generator=generator(seed))
        return window[:, :-1], window[:, 1:]

    return Workload(
        name=name,
        build_model=lambda: Decoder(arch),
        make_batch=make_batch,
        loss_fn=_lm_loss,
        dataset=lambda: TokenDataset(num_samples, arch.seq_len, arch.vocab, seed),
        tokens_per_sample=arch.seq_len,
        default_batch_size=batch_size,
        decoder=arch,
    )


def _gpt2(name: str, layers: int, hidden: int, heads: int, *, seq_len: int, batch_size: int,
          vocab: int = GPT2_VOCAB, num_samples: int = 10_000, seed: int = 0) -> Workload:
    """GPT-2 as a decoder: learned positions, LayerNorm, GELU MLP (4x), biases, head tied to the embedding."""
    return _decoder(name, layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden, vocab=vocab,
                    seq_len=seq_len, mlp="gelu", norm="layernorm", tie_embeddings=True, positions="learned",
                    bias=True, batch_size=batch_size, num_samples=num_samples, seed=seed)


def gpt2_small(*, batch_size: int = 8, seq_len: int = 1024, num_samples: int = 10_000, seed: int = 0) -> Workload:
    """GPT-2 124M: 12 layers, 768 wide, 12 heads."""
    return _gpt2("gpt2-small", 12, 768, 12, seq_len=seq_len, batch_size=batch_size, num_samples=num_samples, seed=seed)


def gpt2_medium(*, batch_size: int = 4, seq_len: int = 1024, num_samples: int = 10_000, seed: int = 0) -> Workload:
    """GPT-2 355M: 24 layers, 1024 wide, 16 heads."""
    return _gpt2("gpt2-medium", 24, 1024, 16, seq_len=seq_len, batch_size=batch_size, num_samples=num_samples,
                 seed=seed)


def gpt2_large(*, batch_size: int = 2, seq_len: int = 1024, num_samples: int = 10_000, seed: int = 0) -> Workload:
    """GPT-2 774M: 36 layers, 1280 wide, 20 heads."""
    return _gpt2("gpt2-large", 36, 1280, 20, seq_len=seq_len, batch_size=batch_size, num_samples=num_samples,
                 seed=seed)


def gpt2_xl(*, batch_size: int = 1, seq_len: int = 1024, num_samples: int = 10_000, seed: int = 0) -> Workload:
    """GPT-2 1.5B: 48 layers, 1600 wide, 25 heads."""
    return _gpt2("gpt2-xl", 48, 1600, 25, seq_len=seq_len, batch_size=batch_size, num_samples=num_samples, seed=seed)


def tiny_gpt2(*, batch_size: int = 2, seq_len: int = 32, vocab: int = 512, num_samples: int = 64,
              seed: int = 0) -> Workload:
    """GPT-2 code path at 2 layers, 64 wide, 4 heads (~0.1M params)."""
    return _gpt2("tiny-gpt2", 2, 64, 4, seq_len=seq_len, batch_size=batch_size, vocab=vocab,
                 num_samples=num_samples, seed=seed)


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn_hidden: int, *, seq_len: int,
           batch_size: int, tied: bool = False, vocab: int = LLAMA3_VOCAB, num_samples: int = 10_000,
           seed: int = 0) -> Workload:
    """Llama 3 as a decoder: RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases."""
    return _decoder(name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn_hidden,
                    vocab=vocab, seq_len=seq_len, mlp="swiglu", norm="rmsnorm", tie_embeddings=tied,
                    positions="rope", bias=False, batch_size=batch_size, num_samples=num_samples, seed=seed)


def llama_1b(*, batch_size: int = 4, seq_len: int = 2048, num_samples: int = 10_000, seed: int = 0) -> Workload:
    """Llama-3.2-1B shape: 16 layers, 2048 wide, 32 heads / 8 KV, FFN 8192, tied embeddings (1.24B)."""
    return _llama("llama-1b", 16, 2048, 32, 8, 8192, seq_len=seq_len, batch_size=batch_size, tied=True,
                  num_samples=num_samples, seed=seed)


def llama_8b(*, batch_size: int = 1, seq_len: int = 2048, num_samples: int = 10_000, seed: int = 0) -> Workload:
    """Llama-3-8B shape: 32 layers, 4096 wide, 32 heads / 8 KV, FFN 14336 (8.03B)."""
    return _llama("llama-8b", 32, 4096, 32, 8, 14336, seq_len=seq_len, batch_size=batch_size,
                  num_samples=num_samples, seed=seed)


def llama_70b(*, batch_size: int = 1, seq_len: int = 2048, num_samples: int = 10_000, seed: int = 0) -> Workload:
    """Llama-3-70B shape: 80 layers, 8192 wide, 64 heads / 8 KV, FFN 28672 (70.6B)."""
    return _llama("llama-70b", 80, 8192, 64, 8, 28672, seq_len=seq_len, batch_size=batch_size,
                  num_samples=num_samples, seed=seed)


def tiny_llama(*, batch_size: int = 2, seq_len: int = 32, vocab: int = 1024, num_samples: int = 64,
               seed: int = 0) -> Workload:
    """Llama code path (GQA 4 heads / 2 KV, SwiGLU, RoPE) at 2 layers, 128 wide (~0.5M params)."""
    return _llama("tiny-llama", 2, 128, 4, 2, 256, seq_len=seq_len, batch_size=batch_size, vocab=vocab,
                  num_samples=num_samples, seed=seed)


def _bert(name: str, layers: int, hidden: int, heads: int, *, seq_len: int, batch_size: int, vocab: int,
          num_samples: int, seed: int) -> Workload:
    """Masked-LM pre-training: batch = (input_ids (B, T), labels (B, T) with -100 where unmasked)."""
    check_positive(name, seq_len=seq_len, batch_size=batch_size, vocab=vocab, num_samples=num_samples)
    check_divisible(name, "hidden", hidden, heads, "heads")
    mask_id = 103 if vocab > 103 else vocab - 1  # [MASK] in the uncased WordPiece vocab

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = generator(seed)
        return mask_tokens(torch.randint(0, vocab, (n, seq_len), generator=g), mask_id, g)

    return Workload(
        name=name,
        build_model=lambda: BertMLM(layers, hidden, heads, vocab, max_positions=seq_len),
        make_batch=make_batch,
        loss_fn=_lm_loss,
        dataset=lambda: MaskedLMDataset(num_samples, seq_len, vocab, mask_id, seed),
        tokens_per_sample=seq_len,
        default_batch_size=batch_size,
    )


def bert_base(*, batch_size: int = 32, seq_len: int = 512, num_samples: int = 10_000, seed: int = 0) -> Workload:
    """BERT-base with its MLM head: 12 layers, 768 wide, 12 heads, vocab 30522 (~110M params)."""
    return _bert("bert-base", 12, 768, 12, seq_len=seq_len, batch_size=batch_size, vocab=BERT_VOCAB,
                 num_samples=num_samples, seed=seed)


def tiny_bert(*, batch_size: int = 2, seq_len: int = 32, vocab: int = 1024, num_samples: int = 64,
              seed: int = 0) -> Workload:
    """BERT code path at 2 layers, 128 wide, 4 heads (~0.5M params)."""
    return _bert("tiny-bert", 2, 128, 4, seq_len=seq_len, batch_size=batch_size, vocab=vocab,
                 num_samples=num_samples, seed=seed)

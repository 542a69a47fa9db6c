"""Language-model presets: bert-base, gpt2-small|medium|large|xl, llama-1b|8b|70b and tiny-* variants.

Decoder presets carry their exact shape as a DecoderArch, which drives the analytic memory
estimator; `seq_len` (tokens per sample) may be shorter than the model's real context.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from advisor.presets._util import check_divisible, check_positive, generator, token_cross_entropy
from advisor.presets.data import MaskedLMDataset, TokenDataset, mask_tokens
from advisor.presets.decoders import GPT2, Llama
from advisor.presets.encoders import BertMLM
from advisor.workload import DecoderArch, Workload

GPT2_VOCAB = 50257
LLAMA3_VOCAB = 128256
BERT_VOCAB = 30522  # WordPiece, uncased


def _lm_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, targets = batch  # (B, T) int64 each
    return token_cross_entropy(model(inputs), targets)


def _decoder_workload(name: str, arch: DecoderArch, build: Any, *, batch_size: int, num_samples: int,
                      seed: int) -> Workload:
    """Next-token prediction on uniform random tokens: batch = (inputs (B, T), targets (B, T))."""
    check_positive(name, batch_size=batch_size, num_samples=num_samples)

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.randint(0, arch.vocab, (n, arch.seq_len + 1), generator=generator(seed))
        return window[:, :-1], window[:, 1:]

    return Workload(
        name=name,
        build_model=build,
        make_batch=make_batch,
        loss_fn=_lm_loss,
        dataset=lambda: TokenDataset(num_samples, arch.seq_len, arch.vocab, seed),
        tokens_per_sample=arch.seq_len,
        default_batch_size=batch_size,
        decoder=arch,
    )


def _gpt2(name: str, layers: int, hidden: int, heads: int, *, seq_len: int, batch_size: int,
          vocab: int = GPT2_VOCAB, num_samples: int = 10_000, seed: int = 0) -> Workload:
    check_positive(name, seq_len=seq_len, vocab=vocab)
    check_divisible(name, "hidden", hidden, heads, "heads")
    arch = DecoderArch(layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn_hidden=4 * hidden,
                       vocab=vocab, seq_len=seq_len, gated_ffn=False, norm="layernorm", tied_embeddings=True,
                       learned_positions=True, bias=True)
    build = lambda: GPT2(layers, hidden, heads, vocab, seq_len)  # noqa: E731
    return _decoder_workload(name, arch, build, batch_size=batch_size, num_samples=num_samples, seed=seed)


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
    check_positive(name, seq_len=seq_len, vocab=vocab)
    check_divisible(name, "hidden", hidden, heads, "heads")
    check_divisible(name, "heads", heads, kv_heads, "kv_heads")
    arch = DecoderArch(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn_hidden=ffn_hidden,
                       vocab=vocab, seq_len=seq_len, gated_ffn=True, norm="rmsnorm", tied_embeddings=tied,
                       learned_positions=False, bias=False)
    build = lambda: Llama(layers, hidden, heads, kv_heads, ffn_hidden, vocab, tied_embeddings=tied)  # noqa: E731
    return _decoder_workload(name, arch, build, batch_size=batch_size, num_samples=num_samples, seed=seed)


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

"""Compute time of one micro-batch through one rank's layers: every matrix product, attention core and
memory-bound elementwise pass of a decoder block on its tensor-parallel slice, against the device's peaks.

A matrix product (m x k) @ (k x n) takes its launch overhead plus the slower of its FLOPs over the sustained
matmul rate and its operand bytes over the memory bandwidth (a roofline per kernel, Williams et al. 2009), so
small products run below peak. Attention runs as FlashAttention does: a causal mask halves its FLOPs (the kernel
skips masked tiles), and its backward does 2.5 times the forward's (Dao 2023, sec. 3: five products against two).
Norms, rotary embeddings, activations and residual adds move their bytes at the memory bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from advisor.workload import DecoderArch


@dataclass(frozen=True)
class DeviceRates:
    """What one device sustains. `matmul_flops`: dense matmul FLOP/s at large sizes (peak x efficiency);
    `attention_flops`: FLOP/s of the fused attention kernels; `bandwidth`: bytes/s of memory traffic;
    `launch_s`: fixed seconds per kernel (launch and tail)."""

    matmul_flops: float
    attention_flops: float
    bandwidth: float
    launch_s: float


@dataclass(frozen=True)
class LayerWork:
    """One micro-batch through one decoder block on one tensor-parallel rank, forward only (seconds, FLOPs)."""

    matmul_s: float
    attention_s: float
    elementwise_s: float
    matmul_flops: float
    attention_flops: float
    frozen_s: float = 0.0  # of matmul_s, the products whose weights are frozen (a fine-tune)
    frozen_flops: float = 0.0  # of matmul_flops, theirs

    @property
    def forward_s(self) -> float:
        return self.matmul_s + self.attention_s + self.elementwise_s

    @property
    def backward_s(self) -> float:
        """Input and weight gradients: two products per forward product, one (the input's) where the weight is
        frozen; FlashAttention's backward 2.5x."""
        return 2 * self.matmul_s - self.frozen_s + 2.5 * self.attention_s + 2 * self.elementwise_s

    @property
    def step_flops(self) -> float:
        """Model FLOPs of the forward and the backward (twice the forward's, less frozen weights' gradients)."""
        return 3 * (self.matmul_flops + self.attention_flops) - self.frozen_flops


def matmul_s(m: int, k: int, n: int, rates: DeviceRates, elt: int) -> float:
    """Seconds of one (m x k) @ (k x n) product whose operands and result are `elt`-byte elements."""
    flops = 2.0 * m * k * n
    traffic = (m * k + k * n + m * n) * elt
    return rates.launch_s + max(flops / rates.matmul_flops, traffic / rates.bandwidth)


def layer_work(arch: DecoderArch, rates: DeviceRates, *, tokens: int, kv_tokens: int, tp: int, sp: bool,
               elt: int, residual_elt: int, frozen: frozenset[str] = frozenset(),
               adapters: tuple[tuple[str, ...], ...] = (), r: int = 0) -> LayerWork:
    """A block's forward on `tokens` query tokens of a micro-batch (samples x seq_len / cp) attending to
    `kv_tokens` keys each (the whole sequence), its heads and FFN columns split `tp` ways. `elt`: bytes of the
    compute dtype; `residual_elt`: of the residual stream (the parameters' dtype under autocast); `sp`: sequence
    parallel, so norms and residual adds touch tokens / tp. A fine-tune's `frozen` roles (parallel_moments.Tuning)
    and LoRA `adapters` of rank `r`, each two products (tokens x in x r, tokens x r x out)."""
    h, f = arch.hidden, arch.ffn_hidden
    head_dim = h // arch.heads
    q, kv = h // tp, arch.kv_heads * head_dim // tp
    products = [(tokens, h, q + 2 * kv), (tokens, q, h)]  # fused q|k|v projection, output projection
    products += [(tokens, h, 2 * f // tp), (tokens, f // tp, h)] if arch.gated_ffn else \
        [(tokens, h, f // tp), (tokens, f // tp, h)]
    # each product's share of frozen weight: its roles' output columns
    ffn = (("w1", "w3"), ("w2",)) if arch.gated_ffn else (("fc",), ("proj",))
    shares = [(q * ("wq" in frozen) + kv * ("wk" in frozen) + kv * ("wv" in frozen)) / (q + 2 * kv),
              float("wo" in frozen)] + [sum(x in frozen for x in roles) / len(roles) for roles in ffn]
    times = [matmul_s(m, k, n, rates, elt) for m, k, n in products]
    frozen_s = sum(t * share for t, share in zip(times, shares))
    frozen_flops = sum(2.0 * m * k * n * share for (m, k, n), share in zip(products, shares))
    if adapters:
        from advisor.estimate.parallel_tuned import linear_io

        io = linear_io(arch, tp)
        for roles in adapters:
            inner, outer = io[roles[0]][0], sum(io[x][1] for x in roles)
            products += [(tokens, inner, r), (tokens, r, outer)]
            times += [matmul_s(tokens, inner, r, rates, elt), matmul_s(tokens, r, outer, rates, elt)]
    mm_s = sum(times)
    mm_flops = sum(2.0 * m * k * n for m, k, n in products)
    # causal: each query attends to the keys before it; with the sequence split in 2 cp head-tail chunks every
    # rank sees the same half of its query x key pairs
    pairs = tokens * kv_tokens / 2
    attn_flops = 4.0 * pairs * q  # Q K^T and P V: 2 FLOPs per multiply-add, over the rank's heads x head_dim
    attn_s = rates.launch_s + attn_flops / rates.attention_flops
    norm_tokens = tokens // tp if sp else tokens
    # elements read + written per token: 2 norms (in, out), 2 residual adds (2 in, 1 out), rotary on q and k,
    # the FFN's activation (SwiGLU reads 2 f and writes f; GELU reads and writes f)
    stream = norm_tokens * (2 * 2 + 2 * 3) * h * residual_elt
    rotary = 0 if arch.learned_positions else tokens * 2 * (q + kv) * elt
    act = tokens * (3 if arch.gated_ffn else 2) * (f // tp) * elt
    elementwise_s = 6 * rates.launch_s + (stream + rotary + act) / rates.bandwidth
    return LayerWork(matmul_s=mm_s, attention_s=attn_s, elementwise_s=elementwise_s, matmul_flops=mm_flops,
                     attention_flops=attn_flops, frozen_s=frozen_s, frozen_flops=frozen_flops)


def head_s(arch: DecoderArch, rates: DeviceRates, *, tokens: int, tp: int, elt: int, frozen: bool = False,
           adapter_r: int = 0) -> tuple[float, float]:
    """(seconds, FLOPs) of the output layer and the loss for one micro-batch, forward and backward: the
    vocabulary-parallel product, three products in all (two where its weight is frozen), and the fp32 log-softmax
    of the rank's vocab / tp logits: the fused kernels read and write it twice; under tp, loss_parallel's
    elementwise ops pass over it 16 times (the maximum, the shifted logits, their exponentials and sum, the
    subtraction; backward's one-hot, exponentials, their sum and its product with the loss's gradient); a LoRA
    adapter of rank `adapter_r` adds its two products, three times each."""
    vocab = -(-arch.vocab // tp)
    mm = matmul_s(tokens, arch.hidden, vocab, rates, elt)
    softmax = (16 if tp > 1 else 4) * tokens * vocab * 4 / rates.bandwidth
    products = 2 if frozen else 3
    seconds, flops = products * mm + softmax, 2.0 * products * tokens * arch.hidden * vocab
    if adapter_r:
        seconds += 3 * (matmul_s(tokens, arch.hidden, adapter_r, rates, elt)
                        + matmul_s(tokens, adapter_r, vocab, rates, elt))
        flops += 6.0 * tokens * adapter_r * (arch.hidden + vocab)
    return seconds, flops

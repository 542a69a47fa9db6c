"""Closed-form memory of a decoder-only transformer, for models too large to trace quickly.

Activation counts follow the method of Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", sec. 4.1: count every tensor saved for backward per
layer), applied to our blocks (advisor/presets/layers.py), with SDPA's fused attention keeping
no (T x T) scores. Per token and layer, in elements:
  GPT-2 block (LayerNorm, fused QKV, GELU MLP): 2h (ln1) + 3h (q, k, v) + h (attn out) + h (proj in)
      + 2h (ln2) + 2f (fc out, gelu out) = 9h + 2f   (= 17h for f = 4h: Korthikanti's 34 bytes at 2 B)
  Llama block (RMSNorm, GQA + RoPE, SwiGLU): 3h (norm) + 3h (q, rotate, q_rope) + 3kv (k likewise)
      + 2h (k, v expanded to H heads) + 2h (attn out, wo in) + 3h (norm) + 4f (w1, silu, w3, product)
      = 13h + 3kv + 4f
plus fp32 logits and their log-softmax (2 x T x V per sample) for the loss. Parameters, gradients
and optimizer state are counted from the shapes (DecoderArch).
"""

from __future__ import annotations

import numpy as np

from advisor.config import OptimizerKind, Precision
from advisor.estimate.model import EstimateRequest
from advisor.estimate.trace import (
    ACTIVATIONS,
    CATEGORY_NAMES,
    GRADS,
    INPUTS,
    OPT_STATE,
    PARAM_COPIES,
    PARAMS,
    STEP_TEMPS,
    TEMPORARIES,
    Trace,
)
from advisor.workload import DecoderArch, Workload

STATE_PER_PARAM = {  # optimizer state elements per parameter (torch.optim)
    OptimizerKind.sgd: 0, OptimizerKind.sgd_momentum: 1, OptimizerKind.adam: 2, OptimizerKind.adamw: 2,
    OptimizerKind.adagrad: 1, OptimizerKind.rowwise_adagrad: 1,
}


def layer_params(d: DecoderArch) -> int:
    kv = d.kv_heads * (d.hidden // d.heads)
    attn = d.hidden * (d.hidden + 2 * kv) + d.hidden * d.hidden
    ffn = (3 if d.gated_ffn else 2) * d.hidden * d.ffn_hidden
    norms = (2 if d.norm == "rmsnorm" else 4) * d.hidden
    biases = (3 * d.hidden + d.hidden + d.ffn_hidden + d.hidden) if d.bias else 0
    return attn + ffn + norms + biases


def decoder_param_count(d: DecoderArch) -> int:
    emb = d.vocab * d.hidden * (1 if d.tied_embeddings else 2)
    pos = d.seq_len * d.hidden if d.learned_positions else 0
    final_norm = d.hidden * (1 if d.norm == "rmsnorm" else 2)
    return d.layers * layer_params(d) + emb + pos + final_norm


def activation_elements_per_token(d: DecoderArch) -> tuple[int, int]:
    """(elements kept in the residual dtype (fp32 under autocast), elements in the compute dtype)."""
    h, f = d.hidden, d.ffn_hidden
    kv = d.kv_heads * (h // d.heads)
    if d.gated_ffn:
        return 2 * h, 11 * h + 3 * kv + 4 * f
    return 2 * h, 7 * h + 2 * f


def analytic_trace(wl: Workload, batch: int, req: EstimateRequest) -> Trace:
    """A three-moment curve (end of forward, start of backward, optimizer step) from formulas."""
    d = wl.decoder
    if d is None:
        raise ValueError(f"{wl.name} has no decoder shape; the analytic path covers decoder presets only")
    n = decoder_param_count(d)
    pure = req.precision == Precision.bf16_pure
    p_bytes = 2 if pure else 4
    compute_bytes = 2 if req.precision in (Precision.bf16, Precision.fp16, Precision.bf16_pure) else 4
    tokens = batch * d.seq_len
    resid, comp = activation_elements_per_token(d)
    per_layer = tokens * (resid * (2 if pure else 4) + comp * compute_bytes)
    checkpoints = d.layers * tokens * d.hidden * 4 if req.checkpointing else 0
    acts = d.layers * (0 if req.checkpointing else per_layer) + checkpoints
    logits = 2 * tokens * d.vocab * 4  # fp32 logits and log-softmax saved for the loss backward
    params = n * p_bytes
    grads = params
    state = STATE_PER_PARAM[req.optimizer] * n * (2 if pure else 4)
    cache = n * 2 if req.precision in (Precision.bf16, Precision.fp16) else 0  # autocast's low-precision weight copies
    block = layer_params(d) * p_bytes
    curve = np.zeros((3, len(CATEGORY_NAMES)), dtype=np.int64)
    curve[:, PARAMS] = params
    curve[:, OPT_STATE] = state
    curve[0, ACTIVATIONS] = acts + logits
    curve[0, PARAM_COPIES] = cache
    curve[0, INPUTS] = curve[1, INPUTS] = tokens * 8
    curve[1, ACTIVATIONS] = acts + logits
    curve[1, TEMPORARIES] = 2 * tokens * d.vocab * 4 + (per_layer if req.checkpointing else 0)  # grad of logits
    curve[1, GRADS] = d.vocab * d.hidden * p_bytes  # the head's gradient, first to arrive
    curve[2, GRADS] = block if req.fused_backward else grads
    curve[2, STEP_TEMPS] = 2 * max(block, d.vocab * d.hidden * p_bytes)  # for-loop step: temporaries of one tensor
    sizes = np.asarray([int(curve[i].sum()) for i in range(3)], dtype=np.int64)
    flops = 6 * n * tokens + 12 * d.layers * d.hidden * d.seq_len * tokens  # Kaplan et al. 2020 + attention
    return Trace(curve=curve, sizes=sizes, ids=np.arange(3, dtype=np.int64),
                 param_bytes=params, grad_bytes=grads, opt_state_bytes=state, largest_block_bytes=block,
                 flops_per_step=int(flops), num_params=n, seconds=0.0, synthetic=True)

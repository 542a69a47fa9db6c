"""Closed-form memory of a decoder-only transformer, for models too large to trace quickly.

Activation counts follow the method of Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", sec. 4.1: count every tensor saved for backward per
layer), applied to our block (advisor/presets/decoders.py: DecoderBlock), with SDPA's fused attention
keeping no (T x T) scores and returning its output in the layout wo reads (no copy). Per token and
layer, in elements (h hidden, f ffn):
  norms, in the residual dtype: LayerNorm 1h each (its input), RMSNorm 2h each (input, normalised x)
  attention: n_q h (norm out, read by wq, wk, wv) + 3h (q, k, v into SDPA; k and v expanded to H heads
      under GQA) + h (SDPA out = wo in); RoPE keeps only its (T, D) tables, shared by the layers
  GELU MLP: n_g h (norm out, read by fc) + 2f (fc out, GELU out)
  SwiGLU: n_s h (norm out, read by w1 and w3) + 4f (w1 out, SiLU out, w3 out, product)
Under autocast each Linear casts its own copy of the norm output (n_q = 3, n_g = 1, n_s = 2); without it
one tensor serves them all (n = 1). GPT-2: 2h + 6h + 2f (autocast 2h + 8h + 2f); Llama: 4h + 6h + 4f
(autocast 4h + 9h + 4f). The norms' per-row statistics (at most 4 elements) are left out; SDPA's logsumexp (H fp32)
is counted apart, as selective checkpointing does not hold it (SDPA runs again in backward; q, k, v stay as its
inputs, its output as wo's). Full checkpointing holds each block's input alone and runs one block again in backward.
Plus fp32 logits and their log-softmax (2 x T x V per sample) for the loss. Parameters, gradients
and optimizer state are counted from the shapes (DecoderArch).
"""

from __future__ import annotations

import numpy as np

from advisor.config import Checkpointing, OptimizerKind, Precision
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
    """Parameters of one DecoderBlock: wq, wk, wv, wo (biases where d.bias), the FFN, two norms."""
    h, f, kv = d.hidden, d.ffn_hidden, d.kv_heads * (d.hidden // d.heads)
    attn = h * (h + 2 * kv) + h * h + ((h + 2 * kv + h) if d.bias else 0)
    ffn = 3 * h * f if d.gated_ffn else 2 * h * f + ((f + h) if d.bias else 0)  # SwiGLU has no biases
    norms = 2 * (h if d.norm == "rmsnorm" else 2 * h)  # LayerNorm: weight and bias
    return attn + ffn + norms


def decoder_param_count(d: DecoderArch) -> int:
    emb = d.vocab * d.hidden * (1 if d.tied_embeddings else 2)
    pos = d.seq_len * d.hidden if d.learned_positions else 0
    final_norm = d.hidden * (1 if d.norm == "rmsnorm" else 2)
    return d.layers * layer_params(d) + emb + pos + final_norm


def activation_elements_per_token(d: DecoderArch, autocast: bool = False) -> tuple[int, int]:
    """(elements kept in the residual dtype (fp32 under autocast), elements in the compute dtype) per token
    and layer (module docstring); `autocast` counts the copy of a norm's output that each Linear casts."""
    h, f = d.hidden, d.ffn_hidden
    norms = 2 * (2 * h if d.norm == "rmsnorm" else h)
    attn = (3 if autocast else 1) * h + 3 * h + h
    ffn = (2 if autocast else 1) * h + 4 * f if d.gated_ffn else h + 2 * f
    return norms, attn + ffn


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
    resid, comp = activation_elements_per_token(d, autocast=req.precision in (Precision.bf16, Precision.fp16))
    full = req.checkpointing == Checkpointing.full
    lse = 0 if req.checkpointing == Checkpointing.selective else tokens * d.heads * 4  # SDPA's, per layer (fp32)
    per_layer = tokens * (resid * (2 if pure else 4) + comp * compute_bytes)
    checkpoints = d.layers * tokens * d.hidden * 4 if full else 0
    acts = d.layers * (0 if full else per_layer + lse) + checkpoints
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
    curve[1, TEMPORARIES] = 2 * tokens * d.vocab * 4 + (per_layer if full else 0)  # grad of logits
    curve[1, GRADS] = d.vocab * d.hidden * p_bytes  # the head's gradient, first to arrive
    curve[2, GRADS] = block if req.fused_backward else grads
    curve[2, STEP_TEMPS] = 2 * max(block, d.vocab * d.hidden * p_bytes)  # for-loop step: temporaries of one tensor
    sizes = np.asarray([int(curve[i].sum()) for i in range(3)], dtype=np.int64)
    flops = 6 * n * tokens + 12 * d.layers * d.hidden * d.seq_len * tokens  # Kaplan et al. 2020 + attention
    return Trace(curve=curve, sizes=sizes, ids=np.arange(3, dtype=np.int64),
                 param_bytes=params, grad_bytes=grads, opt_state_bytes=state, largest_block_bytes=block,
                 flops_per_step=int(flops), num_params=n, seconds=0.0, synthetic=True)

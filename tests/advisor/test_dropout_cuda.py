"""A CUDA target's trace keeps what CUDA's dropout kernels keep (advisor/estimate/dropout_cuda.py): a 1-byte mask
for F.dropout where a CPU keeps the noise in the input's dtype, and nothing of the T x T scores for attention
dropout inside scaled_dot_product_attention, which a CPU runs in the math kernel."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks

from advisor.config import OptimizerKind, Precision
from advisor.estimate.dropout_cuda import cuda_dropout
from advisor.estimate.trace import trace_training


def _saved(f) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The tensors autograd keeps for backward of what `f` computes."""
    out: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        out.append((tuple(t.shape), t.dtype))
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        f()
    return out


def test_dropout_keeps_a_one_byte_mask_as_cuda_does_and_its_expectation_is_unchanged():
    x = torch.ones(64, 256, requires_grad=True)
    assert _saved(lambda: F.dropout(x, 0.25)) == [((64, 256), torch.float32)]  # the CPU's noise
    with cuda_dropout():
        assert _saved(lambda: F.dropout(x, 0.25)) == [((64, 256), torch.bool)]
        assert _saved(lambda: torch.nn.Dropout(0.25)(x)) == [((64, 256), torch.bool)]
        y = F.dropout(x, 0.25)
        # inverted dropout: what is kept is scaled by 1 / (1 - p)
        kept = y[y != 0]
        assert 0.6 < kept.numel() / x.numel() < 0.9 and torch.allclose(kept, torch.full_like(kept, 4 / 3))
        assert F.dropout(x, 0.25, training=False) is x
        # in place, CUDA runs the CPU's kernel too
        assert _saved(lambda: F.dropout(x.clone(), 0.25, inplace=True)) == [((64, 256), torch.float32)]


def test_attention_dropout_keeps_what_the_fused_kernels_keep_not_the_scores():
    q = torch.randn(2, 4, 128, 32, requires_grad=True)
    fused = _saved(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True))
    scores = (2, 4, 128, 128)
    assert scores in [s for s, _ in _saved(lambda: F.scaled_dot_product_attention(q, q, q, None, 0.1, True))]
    with cuda_dropout():
        assert _saved(lambda: F.scaled_dot_product_attention(q, q, q, None, 0.1, True)) == fused
        assert _saved(lambda: F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)) == fused


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.bf16])
def test_a_gpt2_config_with_dropout_traced_for_a_gpu_keeps_cuda_masks(tmp_path, precision: Precision):
    """GPT-2's configs drop out attention probabilities, residuals and embeddings (0.1 each). For a CUDA target
    the attention dropout costs nothing, and the others a byte per element; a CPU keeps the scores and the
    noise."""
    pytest.importorskip("transformers", reason="the hf extra (pip install 'advisor[hf]') is not installed")
    from advisor.workload import load_workload

    layers, seq, batch, heads, hidden = 2, 256, 2, 4, 128
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": hidden, "n_layer": layers,
              "n_head": heads, "vocab_size": 512, "n_positions": seq, "bos_token_id": 0, "eos_token_id": 0}

    def activations(device: str, **drop: float) -> int:
        path = tmp_path / "-".join(f"{k}{v}" for k, v in drop.items())
        path.mkdir(exist_ok=True)
        (path / "config.json").write_text(json.dumps(config | drop))
        workload = load_workload(f"hf:{path}", {"seq_len": seq})
        trace = trace_training(workload, batch, precision=precision, optimizer=OptimizerKind.adamw,
                               device=device, count_flops=False)
        return trace.peak_bytes

    none = dict(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    attn = dict(none, attn_pdrop=0.1)
    assert activations("cuda", **attn) == activations("cuda", **none)
    assert activations("cpu", **attn) - activations("cpu", **none) >= layers * batch * heads * seq * seq * 2
    # residual and embedding dropout: every block's two masks and the embeddings', each batch x seq x hidden
    # bytes; where the peak falls in backward, the last block's last mask is already freed
    mask = batch * seq * hidden
    resid = dict(none, resid_pdrop=0.1, embd_pdrop=0.1)
    added = activations("cuda", **resid) - activations("cuda", **none)
    assert (2 * layers) * mask <= added <= (2 * layers + 1) * mask, added / mask

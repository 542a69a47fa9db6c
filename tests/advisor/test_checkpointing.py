"""Activation checkpointing's three modes: the knob and its booleans, what selective recomputes (real torch steps and
the estimator's trace), and the analytic decoder estimate of it against the trace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from advisor.config import Checkpointing, OptimizerKind, Precision
from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory
from advisor.estimate.trace import trace_training
from advisor.measure import MeasureRequest, replay_memory_events
from advisor.presets import get_preset
from advisor.training import apply_activation_checkpointing
from advisor.trial import TrainingConfig
from advisor.workload import Workload

MODES = tuple(Checkpointing)
DECODER = dict(layers=3, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq_len=128)
BATCH = 4
ATTENTION_WEIGHTS = BATCH * 4 * 128 * 128 * 4  # one layer of _math_attention: (B, H, T, T) fp32 (bytes)


class _MathBlock(nn.Module):
    """Pre-norm attention through SDPA's math backend, which saves the (T, T) attention weights for backward."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        with sdpa_kernel(SDPBackend.MATH):  # matmul, softmax, matmul
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, t, c))


def _math_attention(layers: int = 3, hidden: int = 32, heads: int = 4, seq_len: int = 128) -> Workload:
    def build() -> nn.Module:
        return nn.Sequential(*(_MathBlock(hidden, heads) for _ in range(layers)))

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        return torch.randn(n, seq_len, hidden, generator=g), torch.randn(n, seq_len, hidden, generator=g)

    return Workload(name="math-attention", build_model=build, make_batch=make_batch,
                    loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]), default_batch_size=BATCH)


def test_the_knob_takes_three_modes_and_the_booleans() -> None:
    assert [m.value for m in MODES] == ["none", "selective", "full"]
    for model in (TrainingConfig, EstimateRequest, MeasureRequest):
        kw = {"workload": "tiny-gpt2", "batch_size": 2} if model is MeasureRequest else {}
        assert model(**kw).checkpointing == Checkpointing.none
        assert model(**kw, checkpointing=True).checkpointing == Checkpointing.full
        assert model(**kw, checkpointing=False).checkpointing == Checkpointing.none
        assert model(**kw, checkpointing="selective").checkpointing == Checkpointing.selective
        with pytest.raises(ValueError, match="none', 'selective' or 'full"):
            model(**kw, checkpointing="partial")
    assert TrainingConfig.model_validate_json('{"checkpointing": true}').checkpointing == Checkpointing.full
    assert TrainingConfig(checkpointing="selective").model_dump(mode="json")["checkpointing"] == "selective"
    assert [bool(m) for m in MODES] == [False, True, True]  # `if checkpointing:` means "some mode"
    with pytest.raises(ValueError):
        Checkpointing(1)  # only the booleans stand for modes


def _grads(wl: Workload, mode: Checkpointing) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = wl.build_model()
    wrapped = apply_activation_checkpointing(model, mode)
    assert wrapped == (3 if mode else 0)  # both workloads repeat 3 blocks
    wl.loss_fn(model, wl.make_batch(2)).backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("wl", [get_preset("decoder")(**DECODER), _math_attention()], ids=["decoder", "math"])
def test_every_mode_computes_the_same_gradients(wl: Workload) -> None:
    plain = _grads(wl, Checkpointing.none)
    for mode in (Checkpointing.selective, Checkpointing.full):
        for a, b in zip(plain, _grads(wl, mode)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def _real_peak(wl: Workload, mode: Checkpointing) -> int:
    """Peak live tensor bytes of one real forward and backward (the profiler's memory events)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = wl.build_model()
    apply_activation_checkpointing(model, mode)
    batch = wl.make_batch(BATCH)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        wl.loss_fn(model, batch).backward()
    return replay_memory_events(prof)[0]


def test_selective_holds_less_than_none_and_more_than_full_on_real_steps() -> None:
    # SDPA's math backend saves each layer's (B, H, T, T) attention weights: selective frees them, and holds one
    # layer's again (recomputed, with their gradient) in that layer's backward
    wl = _math_attention()
    none, selective, full = (_real_peak(wl, m) for m in MODES)
    assert none - selective > ATTENTION_WEIGHTS and selective > full, (none, selective, full)
    # The decoder's CPU flash kernel keeps no (T, T) tensor: selective frees its logsumexp alone
    wl = get_preset("decoder")(**DECODER)
    none, selective, full = (_real_peak(wl, m) for m in MODES)
    assert none > selective > full, (none, selective, full)


def _traced(wl: Workload, mode: Checkpointing, precision: Precision = Precision.fp32) -> int:
    return trace_training(wl, BATCH, precision=precision, optimizer=OptimizerKind.adamw, checkpointing=mode,
                          count_flops=False).peak_bytes


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.bf16])
def test_the_trace_records_what_selective_recomputes(precision: Precision) -> None:
    # The decoder's flash kernel (CPU) saves q, k, v, its output and a logsumexp (B, H, T) fp32; under selective
    # q, k, v stay as the checkpoint's inputs and the output as wo's input, so the logsumexp alone is not held.
    wl = get_preset("decoder")(**DECODER)
    none, selective, full = (_traced(wl, m, precision) for m in MODES)
    assert none - selective == DECODER["layers"] * BATCH * DECODER["heads"] * DECODER["seq_len"] * 4
    assert selective > full
    wl = _math_attention()
    none, selective, full = (_traced(wl, m) for m in MODES)
    assert none - selective > ATTENTION_WEIGHTS and selective > full, (none, selective, full)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
def test_the_analytic_estimate_counts_selective_as_the_trace_does(preset: str) -> None:
    def estimate(mode: Checkpointing, method: str):
        return estimate_memory(preset, "h100-sxm", EstimateRequest(batch_size=8, checkpointing=mode),
                               EstimateOptions(method=method))

    for method in ("analytic", "traced"):
        none, selective = estimate(Checkpointing.none, method), estimate(Checkpointing.selective, method)
        assert selective.request.checkpointing == Checkpointing.selective
        arch = get_preset(preset)().decoder
        lse = arch.layers * 8 * arch.heads * arch.seq_len * 4  # SDPA's logsumexp of every layer, fp32
        assert none.breakdown.activations - selective.breakdown.activations == lse, method
    analytic, traced = estimate(Checkpointing.selective, "analytic"), estimate(Checkpointing.selective, "traced")
    assert 0.75 <= analytic.allocated_bytes / traced.allocated_bytes <= 1.25  # test_estimate.py's tolerance

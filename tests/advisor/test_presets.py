"""Built-in presets: every tiny one trains a real CPU step, every one builds on fake tensors,
parameter counts and DecoderArch shapes match the real models, image datasets cost decode time."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.data import Dataset, default_collate

from advisor import DecoderArch, Workload
from advisor.errors import SpecError
from advisor.presets import PRESETS, get_preset

FULL = ["mlp", "resnet18", "resnet50", "vit-b16", "unet", "bert-base", "gpt2-small", "gpt2-medium", "gpt2-large",
        "gpt2-xl", "llama-1b", "llama-8b", "llama-70b", "dlrm", "lstm"]
TINY = ["tiny-mlp", "tiny-resnet", "tiny-vit", "tiny-unet", "tiny-bert", "tiny-gpt2", "tiny-llama", "tiny-dlrm",
        "tiny-lstm", "tiny"]
DECODERS = ["gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama-1b", "llama-8b", "llama-70b",
            "tiny-gpt2", "tiny-llama"]
IMAGE = ["resnet18", "resnet50", "vit-b16", "unet", "tiny-resnet", "tiny-vit", "tiny-unet"]


def _fake_params(name: str, **kwargs: object) -> int:
    with FakeTensorMode():
        return sum(p.numel() for p in get_preset(name)(**kwargs).build_model().parameters())


def _shapes(batch: object) -> object:
    """Nested (shape, dtype) of a batch, ignoring tuple-vs-list (default_collate returns lists)."""
    if isinstance(batch, torch.Tensor):
        return (tuple(batch.shape), batch.dtype)
    if isinstance(batch, dict):
        return {k: _shapes(v) for k, v in batch.items()}
    return [_shapes(b) for b in batch]


def test_registry_holds_exactly_the_documented_names() -> None:
    assert set(PRESETS) == set(FULL) | set(TINY)


def test_unknown_preset_raises_one_line_listing_names() -> None:
    with pytest.raises(SpecError) as info:
        get_preset("gpt5")
    message = str(info.value)
    assert "\n" not in message and "'gpt5'" in message
    for name in ("gpt2-small", "llama-70b", "tiny-mlp", "dlrm"):
        assert name in message


def test_bad_or_invalid_kwargs_raise_spec_error() -> None:
    with pytest.raises(SpecError, match="accepted arguments: .*seq_len"):
        get_preset("gpt2-small")(sequence_length=128)
    with pytest.raises(SpecError, match="batch_size"):
        get_preset("tiny-llama")(batch_size=0)
    with pytest.raises(SpecError, match="image_size"):
        get_preset("unet")(image_size=100)  # not a multiple of 2**depth = 16


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_trains_one_real_step(name: str) -> None:
    torch.manual_seed(0)
    workload = get_preset(name)()
    assert isinstance(workload, Workload)
    start = time.perf_counter()
    model = workload.build_model()
    assert time.perf_counter() - start < 0.5
    n_params = sum(p.numel() for p in model.parameters())
    assert 5e4 <= n_params <= 5e6
    loss = workload.loss_fn(model, workload.make_batch(workload.default_batch_size))
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient for {missing}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("name", TINY)
def test_dataset_rows_match_make_batch_and_are_deterministic(name: str) -> None:
    workload = get_preset(name)(decode_cost_ms=0.0) if name in IMAGE else get_preset(name)()
    dataset = workload.dataset()
    assert isinstance(dataset, Dataset) and len(dataset) > 2
    collate = workload.collate_fn or default_collate
    batch = collate([dataset[0], dataset[1]])
    assert _shapes(batch) == _shapes(workload.make_batch(2))
    torch.testing.assert_close(collate([dataset[0]]), collate([dataset[0]]))
    model = workload.build_model()
    assert math.isfinite(workload.loss_fn(model, batch).item())  # a collated batch is a valid loss input


@pytest.mark.parametrize("name", FULL)
def test_full_preset_builds_fast_and_runs_on_fake_tensors(name: str) -> None:
    workload = get_preset(name)()
    with FakeTensorMode():
        start = time.perf_counter()
        model = workload.build_model()
        assert time.perf_counter() - start < 5.0
        loss = workload.loss_fn(model, workload.make_batch(1))
        loss.backward()
    assert loss.shape == ()
    assert workload.default_batch_size >= 1


@pytest.mark.parametrize(("name", "expected"), [
    ("gpt2-small", 124.44e6), ("gpt2-xl", 1557.6e6), ("llama-1b", 1.236e9), ("llama-8b", 8.03e9),
    ("llama-70b", 70.55e9), ("bert-base", 110e6), ("vit-b16", 86.57e6), ("resnet18", 11.69e6),
    ("resnet50", 25.56e6),
])
def test_param_counts_match_the_real_models(name: str, expected: float) -> None:
    assert _fake_params(name) == pytest.approx(expected, rel=0.03)


def _arch_params(a: DecoderArch) -> int:
    """Parameters implied by a DecoderArch: what the analytic estimator will assume."""
    head_dim = a.hidden // a.heads
    attn = a.hidden * head_dim * (2 * a.heads + 2 * a.kv_heads)  # q, o: H heads; k, v: KV heads
    ffn = a.hidden * a.ffn_hidden * (3 if a.gated_ffn else 2)
    norm = a.hidden * (2 if a.norm == "layernorm" else 1)  # LayerNorm has a bias
    biases = (a.hidden * 3 + a.hidden + a.ffn_hidden + a.hidden) if a.bias else 0
    layer = attn + ffn + 2 * norm + biases
    embeddings = a.vocab * a.hidden * (1 if a.tied_embeddings else 2)
    positions = a.seq_len * a.hidden if a.learned_positions else 0
    return a.layers * layer + embeddings + positions + norm


@pytest.mark.parametrize("name", DECODERS)
def test_decoder_arch_describes_the_built_model(name: str) -> None:
    workload = get_preset(name)()
    arch = workload.decoder
    assert arch is not None and workload.tokens_per_sample == arch.seq_len
    with FakeTensorMode():
        model = workload.build_model()
        assert sum(p.numel() for p in model.parameters()) == _arch_params(arch)
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == arch.layers
    if name.startswith(("llama", "tiny-llama")):
        assert arch.kv_heads < arch.heads and arch.gated_ffn and arch.norm == "rmsnorm" and not arch.bias
    else:
        assert arch.tied_embeddings and arch.learned_positions and arch.norm == "layernorm"


def test_seq_len_and_image_size_are_kwargs() -> None:
    gpt = get_preset("gpt2-small")(seq_len=256)
    assert gpt.decoder is not None and gpt.decoder.seq_len == 256 and gpt.tokens_per_sample == 256
    assert gpt.make_batch(3)[0].shape == (3, 256)
    assert get_preset("llama-8b")(seq_len=4096).decoder.seq_len == 4096
    assert get_preset("resnet50")(image_size=128).make_batch(2)[0].shape == (2, 3, 128, 128)


def test_flags_on_conv_and_embedding_presets() -> None:
    for name in ("resnet18", "resnet50", "unet", "tiny-resnet", "tiny-unet"):
        assert get_preset(name)().conv_net
    assert not get_preset("vit-b16")().conv_net
    assert get_preset("dlrm")().embedding_heavy and get_preset("tiny-dlrm")().embedding_heavy
    assert _fake_params("dlrm", rows=10_000_000) > 5e9  # rows is a kwarg: 8 x 10M x 64


@pytest.mark.parametrize("name", ["tiny-resnet", "tiny-unet", "resnet18"])
def test_image_dataset_item_costs_at_least_decode_cost(name: str) -> None:
    dataset = get_preset(name)(decode_cost_ms=8.0).dataset()
    dataset[0]  # first call also builds the encoded source image
    start = time.perf_counter()
    image, _ = dataset[1]
    assert time.perf_counter() - start >= 0.008
    assert image.dtype == torch.float32 and image.shape[0] == 3 and torch.isfinite(image).all()


def test_listing_presets_does_not_import_torch() -> None:
    code = "import sys, advisor.presets as p; p.get_preset('llama-8b'); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)

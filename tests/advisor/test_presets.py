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
from advisor.estimate.analytic import activation_elements_per_token, decoder_param_count
from advisor.presets import PRESETS, get_preset
from advisor.presets.decoders import Attention, Decoder, DecoderBlock

FULL = ["mlp", "resnet18", "resnet50", "vit-b16", "unet", "bert-base", "gpt2-small", "gpt2-medium", "gpt2-large",
        "gpt2-xl", "llama-1b", "llama-8b", "llama-70b", "dlrm", "lstm"]
TINY = ["tiny-mlp", "tiny-resnet", "tiny-vit", "tiny-unet", "tiny-bert", "tiny-gpt2", "tiny-llama", "tiny-decoder",
        "tiny-dlrm", "tiny-lstm", "tiny"]
SHAPED_BY_ARGS = ["decoder"]  # no default shape: built only from its arguments
DECODERS = ["gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama-1b", "llama-8b", "llama-70b",
            "tiny-gpt2", "tiny-llama", "tiny-decoder"]
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
    assert set(PRESETS) == set(FULL) | set(TINY) | set(SHAPED_BY_ARGS)


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
    attn_bias = head_dim * (a.heads + 2 * a.kv_heads) + a.hidden if a.bias else 0  # q, k, v, o
    ffn = a.hidden * a.ffn_hidden * (3 if a.gated_ffn else 2)
    ffn_bias = a.ffn_hidden + a.hidden if a.bias and not a.gated_ffn else 0  # SwiGLU never has biases
    norm = a.hidden * (2 if a.norm == "layernorm" else 1)  # LayerNorm has a bias
    layer = attn + attn_bias + ffn + ffn_bias + 2 * norm
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
        assert sum(p.numel() for p in model.parameters()) == _arch_params(arch) == decoder_param_count(arch)
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == arch.layers
    if name.startswith(("llama", "tiny-llama", "tiny-decoder")):
        assert arch.kv_heads < arch.heads and arch.gated_ffn and arch.norm == "rmsnorm" and not arch.bias
    else:
        assert arch.tied_embeddings and arch.learned_positions and arch.norm == "layernorm"


@pytest.mark.parametrize(("args", "ffn"), [
    ({"layers": 2, "hidden": 64, "heads": 4}, 256),  # swiglu: 8/3 x 64 = 170, rounded up to 256
    ({"layers": 2, "hidden": 96, "heads": 4, "kv_heads": 2, "mlp": "gelu", "norm": "layernorm", "bias": True,
      "positions": "learned", "tie_embeddings": True}, 384),  # gelu: 4 x hidden
    ({"layers": 1, "hidden": 64, "heads": 8, "kv_heads": 1, "ffn": 100, "mlp": "gelu", "vocab": 300}, 100),
    ({"layers": 1, "hidden": 64, "heads": 2, "norm": "layernorm", "bias": True, "tie_embeddings": True}, 256),
])
def test_decoder_preset_builds_the_shape_its_args_name(args: dict, ffn: int) -> None:
    workload = get_preset("decoder")(seq_len=16, batch_size=2, **args)
    arch = workload.decoder
    assert arch is not None and arch.ffn_hidden == ffn and arch.kv_heads == args.get("kv_heads", args["heads"])
    assert (arch.gated_ffn, arch.learned_positions) == (args.get("mlp") != "gelu", args.get("positions") == "learned")
    torch.manual_seed(0)
    model = workload.build_model()
    assert sum(p.numel() for p in model.parameters()) == _arch_params(arch) == decoder_param_count(arch)
    assert (model.output.weight is model.tok_embeddings.weight) == arch.tied_embeddings
    loss = workload.loss_fn(model, workload.make_batch(2))
    assert math.isfinite(loss.item()) and abs(loss.item() - math.log(arch.vocab)) < 1.0  # near-uniform at init


def test_decoder_preset_at_llama_2_7b_shape_counts_its_parameters() -> None:
    arch = get_preset("decoder")(layers=32, hidden=4096, heads=32, kv_heads=8).decoder
    assert arch is not None and arch.ffn_hidden == 11008 and arch.vocab == 32000  # Llama 2's FFN rule and vocab
    with FakeTensorMode():
        model = Decoder(arch)
        assert sum(p.numel() for p in model.parameters()) == decoder_param_count(arch)


@pytest.mark.parametrize(("args", "message"), [
    ({"heads": 3}, "hidden=64 must be a multiple of heads=3"),
    ({"kv_heads": 3}, "heads=4 must be a multiple of kv_heads=3"),
    ({"mlp": "relu"}, "mlp must be one of swiglu, gelu, got 'relu'"),
    ({"norm": "batchnorm"}, "norm must be one of rmsnorm, layernorm, got 'batchnorm'"),
    ({"positions": "alibi"}, "positions must be one of rope, learned, got 'alibi'"),
    ({"layers": 0}, "layers must be a positive integer, got 0"),
    ({"hidden": -64}, "hidden must be a positive integer, got -64"),
    ({"ffn": 0}, "ffn must be a positive integer, got 0"),
    ({"vocab": 1.5}, "vocab must be a positive integer, got 1.5"),
    ({"seq_len": "long"}, "seq_len must be a positive integer, got 'long'"),
    ({"batch_size": 0}, "batch_size must be a positive integer, got 0"),
    ({"tie_embeddings": "yes"}, "tie_embeddings must be true or false, got 'yes'"),
])
def test_decoder_preset_rejects_bad_args_in_one_line(args: dict, message: str) -> None:
    with pytest.raises(SpecError) as info:
        get_preset("decoder")(**{"layers": 2, "hidden": 64, "heads": 4, **args})
    assert str(info.value) == f"preset 'decoder': {message}"


def test_decoder_arch_rejects_heads_that_do_not_divide() -> None:
    shape = dict(layers=1, ffn_hidden=8, vocab=8, seq_len=8, gated_ffn=True, norm="rmsnorm")
    with pytest.raises(ValueError, match="hidden=64 must be a multiple of heads=3"):
        DecoderArch(hidden=64, heads=3, kv_heads=3, **shape)
    with pytest.raises(ValueError, match="heads=4 must be a multiple of kv_heads=3"):
        DecoderArch(hidden=64, heads=4, kv_heads=3, **shape)


def test_decoder_preset_needs_its_shape() -> None:
    with pytest.raises(SpecError, match="missing a required argument: 'layers'.*accepted arguments: layers"):
        get_preset("decoder")(hidden=64, heads=4)


@pytest.mark.parametrize(("heads", "kv_heads", "rope"), [(8, 4, True), (8, 8, False), (4, 2, False)])
def test_attention_split_by_heads_sums_to_the_full_output(heads: int, kv_heads: int, rope: bool) -> None:
    """Two shards holding half the query and key/value heads each (wq, wk, wv rows; wo columns; wo's bias on
    one), as tensor parallelism splits them: their outputs add up to the whole module's."""
    torch.manual_seed(0)
    hidden, t = 64, 12
    full = Attention(hidden, heads, kv_heads, bias=True)
    for p in full.parameters():  # non-zero biases, so a misplaced bias shows
        nn.init.normal_(p, std=0.1)
    tables = Decoder(DecoderArch(layers=1, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn_hidden=8, vocab=8,
                                 seq_len=t, gated_ffn=True, norm="rmsnorm")).rope(t, "cpu") if rope else None
    x = torch.randn(2, t, hidden)
    q_rows, kv_rows = heads * full.head_dim // 2, kv_heads * full.head_dim // 2
    outputs = []
    for rank in range(2):
        shard = Attention(hidden, heads, kv_heads, bias=True)
        q, kv = slice(rank * q_rows, (rank + 1) * q_rows), slice(rank * kv_rows, (rank + 1) * kv_rows)
        for name, rows in (("wq", q), ("wk", kv), ("wv", kv)):
            part, whole = getattr(shard, name), getattr(full, name)
            part.weight, part.bias = nn.Parameter(whole.weight[rows]), nn.Parameter(whole.bias[rows])
        shard.wo.weight = nn.Parameter(full.wo.weight[:, q])
        shard.wo.bias = nn.Parameter(full.wo.bias if rank == 0 else torch.zeros(hidden))
        with torch.no_grad():
            outputs.append(shard(x, tables))
    with torch.no_grad():
        whole = full(x, tables)
    torch.testing.assert_close(outputs[0] + outputs[1], whole)
    assert not torch.allclose(outputs[0], whole, atol=1e-3)  # each shard alone is only part of it


@pytest.mark.parametrize("args", [{"tie_embeddings": True}, {"mlp": "gelu", "norm": "layernorm", "bias": True,
                                                              "positions": "learned"}])
def test_decoder_built_on_meta_materialises_and_trains(args: dict) -> None:
    workload = get_preset("tiny-decoder")(**args)
    with torch.device("meta"):
        model = workload.build_model()
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    assert sum(p.numel() for p in model.parameters()) == decoder_param_count(workload.decoder)  # tie restored
    assert 0.015 < model.tok_embeddings.weight.std().item() < 0.025
    assert all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in model.modules()
               if isinstance(m, (nn.LayerNorm, nn.RMSNorm)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batch = workload.make_batch(4)
    first = workload.loss_fn(model, batch)
    first.backward()
    optimizer.step()
    with torch.no_grad():
        second = workload.loss_fn(model, batch)
    assert math.isfinite(first.item()) and second.item() < first.item()


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
@pytest.mark.parametrize("autocast", [False, True])
def test_block_saves_what_the_analytic_estimator_counts(name: str, autocast: bool) -> None:
    """Elements a DecoderBlock saves for backward per token: the residual-dtype and compute-dtype counts of
    activation_elements_per_token, up to the norms' and SDPA's per-row statistics (H + 4)."""
    arch = get_preset(name)(seq_len=16).decoder
    block, tables = DecoderBlock(arch), Decoder(arch.model_copy(update={"layers": 1})).rope(16, "cpu")

    def saved(batch: int) -> dict[torch.dtype, int]:
        storages: dict[int, tuple[int, torch.dtype]] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storages[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes() // t.itemsize, t.dtype)
            return t

        x = torch.randn(batch, 16, arch.hidden, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            block(x, tables)
        out: dict[torch.dtype, int] = {}
        for elements, dtype in storages.values():
            out[dtype] = out.get(dtype, 0) + elements
        return out

    small, large = saved(2), saved(4)  # the difference leaves out weights and their autocast copies
    per_token = {dtype: (large[dtype] - small.get(dtype, 0)) / (2 * 16) for dtype in large}
    resid, compute = activation_elements_per_token(arch, autocast=autocast)
    if autocast:
        assert per_token[torch.bfloat16] == compute
        assert 0 <= per_token[torch.float32] - resid <= arch.heads + 4
    else:
        assert set(per_token) == {torch.float32} and 0 <= per_token[torch.float32] - resid - compute <= arch.heads + 4


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

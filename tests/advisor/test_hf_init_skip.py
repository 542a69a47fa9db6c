"""A Hugging Face model whose weight init reads tensor values (ViT's trunc_normal_ through transformers'
own table of torch's initializers) is traced on fake tensors with those initializers skipped, not estimated
from real steps at small batches."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers", reason="the hf extra (pip install 'advisor[hf]') is not installed")

from advisor.config import OptimizerKind, Precision  # noqa: E402
from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory  # noqa: E402
from advisor.estimate.trace import trace_training  # noqa: E402
from advisor.workload import load_workload  # noqa: E402

VIT = {"model_type": "vit", "architectures": ["ViTForImageClassification"], "hidden_size": 64,
       "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "image_size": 32,
       "patch_size": 8, "num_channels": 3, "num_labels": 3}


def test_a_vit_config_traces_on_fake_tensors_with_transformers_initializers_skipped(tmp_path) -> None:
    import transformers.initialization as hf_init

    (tmp_path / "config.json").write_text(json.dumps(VIT))
    workload = load_workload(f"hf:{tmp_path}")
    table = dict(hf_init.TORCH_INIT_FUNCTIONS)
    kw = dict(precision=Precision.fp32, optimizer=OptimizerKind.adamw, count_flops=False)
    fake, real = trace_training(workload, 8, **kw), trace_training(workload, 8, fake=False, **kw)
    # initial values change no memory: the fake trace allocates what real tensors do
    assert fake.init_skipped and fake.peak_bytes == real.peak_bytes
    assert hf_init.TORCH_INIT_FUNCTIONS == table  # transformers' initializers are whole again
    est = estimate_memory(f"hf:{tmp_path}", "h100-sxm", EstimateRequest(batch_size=8),
                          EstimateOptions(calibrate=False, measured=False))
    assert est.method == "traced" and not any("cannot trace" in n for n in est.notes), est.notes
    assert any("initializers skipped" in n for n in est.notes), est.notes

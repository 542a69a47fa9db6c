"""Hugging Face configs as workloads (`-w hf:PATH`): each covered task built from a config.json with no weights and
stepped for real with the model's own loss, `advisor estimate`, `trial` and `plan` on them through the command
line, config overrides coerced to the key's type, and bad input as one line with exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the hf extra (pip install 'advisor[hf]') is not installed")

from advisor.errors import SpecError  # noqa: E402
from advisor.workload import load_workload  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 256
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
         "max_position_embeddings": 128, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
BERT = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": VOCAB, "max_position_embeddings": 64}
CONFIGS = {
    "llama": LLAMA,
    "gpt2": {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 2, "n_head": 4,
             "n_positions": 64, "vocab_size": VOCAB},
    "bert": {**BERT, "architectures": ["BertForMaskedLM"]},
    "bert-cls": {**BERT, "architectures": ["BertForSequenceClassification"],
                 "id2label": {"0": "a", "1": "b", "2": "c"}, "label2id": {"a": 0, "b": 1, "c": 2}},
    "t5": {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "d_model": 64, "d_ff": 128,
           "d_kv": 16, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4, "vocab_size": VOCAB,
           "is_encoder_decoder": True, "pad_token_id": 0, "decoder_start_token_id": 0},
    "vit": {"model_type": "vit", "architectures": ["ViTForImageClassification"], "hidden_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "image_size": 32,
            "patch_size": 8, "num_channels": 3, "id2label": {"0": "a", "1": "b"}, "label2id": {"a": 0, "b": 1}},
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, Path]:
    """Each config in a model directory of its own (named after the key), as a downloaded config.json is."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, config in CONFIGS.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        out[name] = root / name
    bare = dict(LLAMA)
    del bare["architectures"]
    (root / "bare.json").write_text(json.dumps(bare))
    out["bare"] = root / "bare.json"
    return out


def advisor(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "advisor.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "80"})
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize("name, cls, labels", [
    ("llama", "LlamaForCausalLM", "ids"), ("gpt2", "GPT2LMHeadModel", "ids"), ("bert", "BertForMaskedLM", "ids"),
    ("bert-cls", "BertForSequenceClassification", (3,)), ("t5", "T5ForConditionalGeneration", (VOCAB,)),
    ("vit", "ViTForImageClassification", (2,))])
def test_each_task_steps_with_the_models_own_loss(configs, name, cls, labels):
    import torch

    wl = load_workload(f"hf:{configs[name]}", {"seq_len": 16} if name != "vit" else {})
    model = wl.build()
    assert type(model).__name__ == cls and wl.decoder is None
    assert wl.name == f"hf:{CONFIGS[name]['model_type']}/{name}"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    batch = wl.make_batch(3)
    if name == "vit":
        assert batch["pixel_values"].shape == (3, 3, 32, 32) and wl.tokens_per_sample is None
    else:
        ids = batch["input_ids"]
        assert ids.shape == (3, 16) and 0 <= int(ids.min()) and int(ids.max()) < VOCAB and wl.tokens_per_sample == 16
        assert ids.dtype == torch.int64
    if labels == "ids":
        assert torch.equal(batch["labels"], batch["input_ids"])
    else:
        assert batch["labels"].shape[0] == 3 and int(batch["labels"].max()) < labels[0]
    loss = wl.loss_fn(model, batch)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    if model.config._attn_implementation != "sdpa":  # SDPA wherever transformers has it for the model
        assert name == "t5"


def test_estimate_counts_the_models_parameters(configs):
    model = load_workload(f"hf:{configs['llama']}", {"num_hidden_layers": 1}).build()
    params = sum(p.numel() for p in model.parameters())
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])  # RoPE's buffers too
    proc = advisor("estimate", "-w", f"hf:{configs['llama']}", "-a", "num_hidden_layers=1", "-a", "seq_len=32",
                   "-H", "h100-sxm", "-b", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    est = json.loads(proc.stdout)
    assert est["workload"] == "hf:llama/llama" and est["num_params"] == params and est["fits"]
    assert est["breakdown"]["parameters"] == held == 4 * params + 4 * sum(b.numel() for b in model.buffers())
    assert est["max_batch_size"] > 4 and est["method"] != "analytic"


def test_a_trial_of_a_llama_config_runs(configs):
    proc = advisor("trial", "-w", f"hf:{configs['llama']}", "-a", "seq_len=16", "-H", "cpu", "--set", "batch_size=2",
                   "--warmup-steps", "1", "--min-steps", "2", "--min-time", "0.1", "--settle", "0", "--no-estimate",
                   "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    result = json.loads(proc.stdout)
    assert result["status"] == "ok", result
    assert result["samples_per_s"] > 0 and result["tokens_per_s"] == pytest.approx(16 * result["samples_per_s"])


def test_plan_takes_the_decoder_of_the_configs_shape(configs):
    from advisor.presets.decoders import Decoder
    from advisor.presets.hf import hf_decoder_arch

    wl = load_workload(f"hf:{configs['llama']}", {"seq_len": 128})
    arch = hf_decoder_arch(wl)
    assert (arch.layers, arch.hidden, arch.heads, arch.kv_heads, arch.ffn_hidden, arch.vocab, arch.seq_len) == \
        (2, 64, 4, 2, 128, VOCAB, 128)
    assert arch.gated_ffn and arch.norm == "rmsnorm" and not arch.tied_embeddings and not arch.bias
    for name in ("llama", "gpt2"):  # the advisor's decoder of that shape holds the same parameters
        wl = load_workload(f"hf:{configs[name]}")
        own = sum(p.numel() for p in Decoder(hf_decoder_arch(wl)).parameters())
        assert own == sum(p.numel() for p in wl.build().parameters()), name
    assert hf_decoder_arch(load_workload(f"hf:{configs['bert']}")) is None
    from advisor.plan.search import PlanRequest, plan

    got = plan(PlanRequest(workload=f"hf:{configs['llama']}", workload_args={"seq_len": 128}, hardware=["h100-sxm:8"],
                           global_batch_size=64, top=2))
    assert got.workload == "hf:llama/llama" and got.fits and got.plans and got.tokens_per_step == 64 * 128
    assert any("planned as the advisor's decoder" in n for n in got.notes)
    with pytest.raises(SpecError, match="is not a decoder"):
        plan(PlanRequest(workload=f"hf:{configs['bert']}", hardware=["h100-sxm:8"]))


def test_a_hub_name_is_one_line_that_suggests_the_local_path():
    line = one_line_error(advisor("estimate", "-w", "hf:meta-llama/Llama-3.1-8B", "-H", "h100-sxm"))
    assert "hub is not reached" in line and "config.json" in line


def test_uncovered_architectures_are_named(configs, tmp_path):
    with pytest.raises(SpecError, match="no architectures; covered: causal-lm"):
        load_workload(f"hf:{configs['bare']}")
    (tmp_path / "config.json").write_text(json.dumps({**CONFIGS["bert"], "architectures": ["BertForPreTraining"]}))
    with pytest.raises(SpecError, match=r"architectures \['BertForPreTraining'\]; covered"):
        load_workload(f"hf:{tmp_path}")
    with pytest.raises(SpecError, match="has no config.json"):
        load_workload(f"hf:{tmp_path.parent}")


def test_overrides_take_the_config_keys_type(configs):
    wl = load_workload(f"hf:{configs['llama']}", {"num_hidden_layers": "1", "rms_norm_eps": "1e-6",
                                                  "tie_word_embeddings": "true", "hidden_act": "gelu"})
    c = wl.build().config
    assert c.num_hidden_layers == 1 and isinstance(c.num_hidden_layers, int)
    assert c.rms_norm_eps == 1e-6 and c.tie_word_embeddings is True and c.hidden_act == "gelu"
    gpt2 = load_workload(f"hf:{configs['gpt2']}", {"num_hidden_layers": 1.0}).build()  # gpt2's n_layer
    assert gpt2.config.n_layer == 1 and len(gpt2.transformer.h) == 1
    with pytest.raises(SpecError, match="close config keys: num_hidden_layers"):
        load_workload(f"hf:{configs['llama']}", {"num_hiden_layers": 1})
    with pytest.raises(SpecError, match="num_hidden_layers takes type int"):
        load_workload(f"hf:{configs['llama']}", {"num_hidden_layers": "two"})
    with pytest.raises(SpecError, match=r"not valid: ValueError: The hidden size \(66\) is not a multiple"):
        load_workload(f"hf:{configs['llama']}", {"hidden_size": 66})  # the config's own check, in one line
    with pytest.raises(SpecError, match="over the config's 128 positions"):
        load_workload(f"hf:{configs['llama']}", {"seq_len": 256})


def test_the_core_runs_without_the_extra(configs):
    """advisor and its CLI import no transformers; without it an hf: workload is one line naming the extra."""
    code = f"""
import sys
import advisor, advisor.cli, advisor.workload
assert "transformers" not in sys.modules, "advisor imported transformers"
sys.modules["transformers"] = None  # as if the hf extra were not installed: importing it raises ImportError
try:
    advisor.workload.load_workload({f"hf:{configs['llama']}"!r})
except advisor.errors.SpecError as exc:
    print(exc)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "hf: workloads need the hf extra: pip install 'advisor[hf]'"


def test_recommend_plans_a_config_and_its_lora_fine_tune_data_parallel(configs, sqlite_url):
    """On eight GPUs recommend answers an hf: causal LM, and a LoRA fine-tune of it, from the planner, data parallel
    (the trial's tensor and pipeline plans know the advisor's decoder's modules, not the config's)."""
    from advisor.finetune import FineTune, LoraSpec, with_finetune
    from advisor.recommend import recommend

    spec = f"hf:{configs['llama']}"
    lora = with_finetune({"seq_len": 128}, FineTune(lora=LoraSpec(r=4, targets=("q_proj", "v_proj"))))
    for args in ({"seq_len": 128}, lora):
        (rec,) = recommend(spec, "h100-sxm:8", workload_args=args, db=sqlite_url)
        c = rec.config
        assert rec.provenance == "planned" and rec.fits and c.nproc == 8, rec.reason
        assert (c.tp, c.pp, c.cp) == (1, 1, 1), rec.reason


def test_the_api_plans_a_config(configs, sqlite_url, tmp_path):
    """POST /v1/plan over the app takes an hf: workload under ADVISOR_HF_CONFIG_DIRS (the planner reads it in its
    worker); a hub name, a path outside those folders (a symbolic link out of one included) and any hf: path on a
    server without them are a 403 with their line, before anything is read."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # starlette's note about httpx's successor
        from fastapi.testclient import TestClient

    from advisor.settings import Settings
    from api.app import create_app

    spec = f"hf:{configs['llama']}"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "config.json").write_text(json.dumps(LLAMA))
    (configs["llama"].parent / "escape").symlink_to(outside)
    allowed = Settings(database_url=sqlite_url, hf_config_dirs=f"{configs['llama'].parent}, /nonexistent")
    with TestClient(create_app(sqlite_url, settings=allowed), raise_server_exceptions=False) as c:
        r = c.post("/v1/plan", json={"workload": spec, "hardware": ["h100-sxm:8"], "global_batch_size": 64, "top": 1})
        assert r.status_code == 200, r.text
        assert r.json()["workload"] == "hf:llama/llama" and r.json()["plans"]
        r = c.post("/v1/estimate", json={"workload": "hf:meta-llama/Llama-3.1-8B", "hardware": "h100-sxm"})
        assert r.status_code == 403 and "hub is not reached" in r.json()["detail"], r.text
        for path in (outside, configs["llama"].parent / "escape", configs["llama"].parent / ".." / "elsewhere"):
            r = c.post("/v1/estimate", json={"workload": f"hf:{path}", "hardware": "h100-sxm"})
            assert r.status_code == 403 and "outside ADVISOR_HF_CONFIG_DIRS" in r.json()["detail"], r.text
    with TestClient(create_app(sqlite_url, settings=Settings(database_url=sqlite_url)),
                    raise_server_exceptions=False) as c:
        r = c.post("/v1/plan", json={"workload": spec, "hardware": ["h100-sxm:8"]})
        assert r.status_code == 403 and "ADVISOR_HF_CONFIG_DIRS" in r.json()["detail"], r.text

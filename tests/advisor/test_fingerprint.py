"""workload_fingerprint: stable across processes, sensitive to shapes, blind to values."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from advisor.fingerprint import config_key, fingerprint_payload, workload_fingerprint
from advisor.workload import load_workload

CHILD = ("import json,sys; from advisor.fingerprint import workload_fingerprint; "
         "from advisor.workload import load_workload; "
         "print(workload_fingerprint(load_workload(sys.argv[1], json.loads(sys.argv[2]))))")


def _in_fresh_process(spec: str, args: str = "{}", hash_seed: str = "0") -> str:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)  # str hashes (and so set orders) differ between processes
    out = subprocess.run([sys.executable, "-c", CHILD, spec, args], capture_output=True, text=True, env=env, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_same_preset_in_two_processes_gives_the_same_fingerprint() -> None:
    here = workload_fingerprint(load_workload("tiny-gpt2"))
    assert _in_fresh_process("tiny-gpt2", hash_seed="1") == here
    assert _in_fresh_process("tiny-gpt2", hash_seed="2") == here
    assert len(here) == 32 and int(here, 16) >= 0


def test_width_and_seq_len_change_the_fingerprint() -> None:
    mlp = workload_fingerprint(load_workload("tiny-mlp"))
    assert workload_fingerprint(load_workload("tiny-mlp", {"hidden": 512})) != mlp
    gpt = workload_fingerprint(load_workload("tiny-gpt2"))
    assert workload_fingerprint(load_workload("tiny-gpt2", {"seq_len": 64})) != gpt
    assert gpt != mlp


def test_values_do_not_enter_the_fingerprint() -> None:
    # another seed gives other weights and batches of the same shapes: the same memory behaviour
    seeded = workload_fingerprint(load_workload("tiny-gpt2", {"seed": 7}))
    assert seeded == workload_fingerprint(load_workload("tiny-gpt2"))


def test_batch_dimension_is_abstracted_and_model_built_on_meta() -> None:
    payload = fingerprint_payload(load_workload("tiny-gpt2", {"seq_len": 48}))
    # (inputs, targets), each (B, 48) int64
    assert payload["batch"] == ["tuple", [["B", 48], "torch.int64"], [["B", 48], "torch.int64"]]
    assert payload["modules"][:3] == [["", "Decoder"], ["tok_embeddings", "Embedding"], ["pos_embeddings", "Embedding"]]
    assert any(shape == [512, 64] for _, shape, _, _ in payload["parameters"])  # the token embedding, vocab x width


def test_user_file_workload_is_stable_across_processes(tmp_path: Path) -> None:
    # a file's module is imported under a name salted by hash(): the fingerprint must not see it
    f = tmp_path / "wl.py"
    f.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        import advisor

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(16, 4)
                self.register_buffer("scale", torch.ones(4))

            def forward(self, x):
                return self.fc(x) * self.scale

        def build(width=16):
            return advisor.Workload(name="file-net", build_model=Net,
                                    make_batch=lambda n: {"x": torch.randn(n, 16), "y": torch.randn(n, 4)},
                                    loss_fn=lambda m, b: ((m(b["x"]) - b["y"]) ** 2).mean())
    """))
    spec = f"{f}:build"
    assert _in_fresh_process(spec, hash_seed="3") == _in_fresh_process(spec, hash_seed="4")
    payload = fingerprint_payload(load_workload(spec))
    assert payload["buffers"] == [["scale", [4], "torch.float32", False]]
    assert payload["batch"] == {"x": [["B", 16], "torch.float32"], "y": [["B", 4], "torch.float32"]}


def test_config_key_orders_knobs() -> None:
    assert config_key("f", "cpu", {"b": 1, "a": "x"}) == config_key("f", "cpu", {"a": "x", "b": 1}) == "f|cpu|a=x|b=1"
    assert config_key("f", "cpu", {"a": 1}) != config_key("f", "h100-sxm", {"a": 1})

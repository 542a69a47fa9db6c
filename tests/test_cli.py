"""The `advisor` command line, run as a real subprocess: JSON and table output, one-line errors
with exit 2 for every user mistake, the real-step fallback for untraceable models, and listings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = {"parameters", "gradients", "optimizer_state", "activations", "temporaries", "overhead"}


def advisor(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "80"}  # what a pipe gets: rich's default width
    proc = subprocess.run([sys.executable, "-m", "advisor.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def assert_one_line_usage_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def workload_files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("workloads")
    (d / "import_error.py").write_text('raise ImportError("needs the package flux_capacitor")\n')
    (d / "build_error.py").write_text('def build():\n    raise RuntimeError("dataset path not set")\n')
    (d / "data_dependent.py").write_text('''\
import torch
import torch.nn.functional as F
from torch import nn

from advisor import Workload


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 4)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:  # data-dependent control flow: fake tensors cannot decide it
            h = torch.relu(h)
        return self.b(h)


def build():
    def make_batch(n):
        g = torch.Generator().manual_seed(0)
        return torch.randn(n, 32, generator=g), torch.randint(0, 4, (n,), generator=g)

    return Workload(name="gated", build_model=Gated, make_batch=make_batch,
                    loss_fn=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]))
''')
    return d


def test_estimate_json_has_the_documented_keys() -> None:
    proc = advisor("estimate", "-w", "tiny-mlp", "-H", "cpu", "--no-calibrate", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in ("total_bytes", "allocated_bytes", "breakdown", "fits", "device_memory_bytes", "max_batch_size",
                "predicts"):
        assert key in out, key
    assert set(out["breakdown"]) == PARTS
    assert sum(out["breakdown"].values()) == out["total_bytes"]
    assert out["predicts"] == "cpu_rss"
    assert out["fits"] is True and out["max_batch_size"] > 0
    assert out["calibrated"] is False


def test_estimate_table_names_the_largest_batch() -> None:
    proc = advisor("estimate", "-w", "tiny-mlp", "-H", "h100-sxm")
    assert proc.returncode == 0, proc.stderr
    # a 0.1M-parameter MLP on an 80 GB GPU fits past the search's limit (2**22), which the table says
    assert "largest batch that fits: >= 4194304" in proc.stdout
    assert "cuda_reserved" in proc.stdout


def test_unknown_preset_is_one_line_listing_valid_names() -> None:
    line = assert_one_line_usage_error(advisor("estimate", "-w", "gpt5-huge", "-H", "cpu", "--no-calibrate"))
    assert "valid" in line and "gpt5-huge" in line and "gpt2-small" in line


def test_unknown_hardware_is_one_line() -> None:
    line = assert_one_line_usage_error(advisor("estimate", "-w", "tiny-mlp", "-H", "h900-sxm", "--no-calibrate"))
    assert "h900-sxm" in line and "h100-sxm" in line


# main() in a fresh process, then: its exit code, whether torch was imported, how many fork servers it started
IN_PROCESS = """
import sys
from advisor.cli import main
code = main(sys.argv[1:])
print(code, "torch" in sys.modules, len(getattr(sys.modules.get("advisor.isolation.forkserver"), "_SERVERS", {})))
"""


@pytest.mark.parametrize("args", [
    ("estimate", "-w", "tiny-mlp", "-H", "h900-sxm"),
    ("estimate", "-w", "tiny-mlp", "-H", "local:2", "--tp", "2"),
    ("recommend", "-w", "tiny-mlp", "-H", "l4", "-H", "nope"),
    ("recommend", "-w", "tiny-mlp", "-H", "l4", "--price", "a100-80gb=2"),
    ("plan", "-w", "llama-8b", "-H", "h100-sxm:0"),
    ("plan", "-w", "llama-8b", "-H", "h100-sxm:8", "--fix", "bogus=1"),
    ("tune", "-w", "tiny-mlp", "-H", "h900-sxm"),
], ids=lambda a: " ".join(a[:1] + a[3:]))
def test_a_bad_hardware_price_or_knob_is_refused_before_torch_or_a_workers_fork_server_starts(args) -> None:
    proc = subprocess.run([sys.executable, "-c", IN_PROCESS, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.split() == ["2", "False", "0"], (proc.stdout, proc.stderr)
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_workload_file_failing_at_import_is_one_line_naming_it(workload_files: Path) -> None:
    path = workload_files / "import_error.py"
    line = assert_one_line_usage_error(advisor("estimate", "-w", f"{path}:build", "-H", "cpu", "--no-calibrate"))
    assert str(path) in line and "ImportError" in line and "flux_capacitor" in line


def test_workload_build_raising_is_one_line(workload_files: Path) -> None:
    path = workload_files / "build_error.py"
    line = assert_one_line_usage_error(advisor("estimate", "-w", f"{path}:build", "-H", "cpu", "--no-calibrate"))
    assert "build()" in line and "dataset path not set" in line


def test_zero_batch_size_is_one_line() -> None:
    line = assert_one_line_usage_error(advisor("estimate", "-w", "tiny-mlp", "-H", "cpu", "--batch-size", "0"))
    assert "--batch-size" in line and "positive" in line


@pytest.mark.parametrize("command", ["trial", "tune"])
def test_a_negative_settle_wait_is_one_line_naming_the_flag(command: str) -> None:
    line = assert_one_line_usage_error(advisor(command, "-w", "tiny-mlp", "-H", "cpu", "--settle", "-1"))
    assert "--settle" in line and "greater than or equal to 0" in line


def test_unknown_precision_is_one_line_listing_allowed() -> None:
    line = assert_one_line_usage_error(advisor("estimate", "-w", "tiny-mlp", "-H", "cpu", "--precision", "fp64"))
    assert "fp64" in line
    for allowed in ("fp32", "bf16", "fp16", "bf16-pure"):
        assert allowed in line


def test_data_dependent_model_falls_back_to_real_steps(workload_files: Path) -> None:
    path = workload_files / "data_dependent.py"
    proc = advisor("estimate", "-w", f"{path}:build", "-H", "cpu", "--no-calibrate", "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["method"] == "measured"
    notes = " ".join(out["notes"])
    assert "fell back" in notes and "real steps" in notes
    assert out["allocated_bytes"] > 0 and sum(out["breakdown"].values()) == out["total_bytes"]


def test_workloads_lists_presets() -> None:
    proc = advisor("workloads")
    assert proc.returncode == 0, proc.stderr
    names = proc.stdout.split()
    assert "gpt2-small" in names and "tiny-mlp" in names


def test_hardware_lists_catalog() -> None:
    proc = advisor("hardware")
    assert proc.returncode == 0, proc.stderr
    assert "h100-sxm" in proc.stdout
    # Then this machine's CPU: what it is, and its derived peak (or why the catalog's stands in).
    from advisor.hardware import get_hardware

    cpu = get_hardware("cpu").accelerator.cpu
    assert f"CPU: {cpu.model_name} (" in proc.stdout
    peaks = cpu.peak_tflops()
    said = f"= fp32 {peaks['fp32']:.3g}, bf16 {peaks['bf16']:.3g} TFLOP/s" if peaks else "derived peak: unknown"
    assert said in proc.stdout


def test_hardware_table_shows_every_name_in_full() -> None:
    from advisor.hardware import CATALOG

    proc = advisor("hardware")
    assert proc.returncode == 0, proc.stderr
    missing = [name for name in CATALOG if name not in proc.stdout]
    assert not missing, missing


def test_hardware_json_lists_catalog() -> None:
    proc = advisor("hardware", "--json")
    assert proc.returncode == 0, proc.stderr
    assert {"h100-sxm", "a100-80gb", "tiny", "cpu"} <= set(json.loads(proc.stdout))


def test_checkpointing_takes_a_mode_and_alone_means_full() -> None:
    for flag, mode in ((["--checkpointing"], "full"), (["--checkpointing", "selective"], "selective")):
        proc = advisor("estimate", "-w", "tiny-gpt2", "-H", "h100-sxm", "--json", *flag)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["request"]["checkpointing"] == mode
    line = assert_one_line_usage_error(advisor("estimate", "-w", "tiny-gpt2", "-H", "h100-sxm", "--checkpointing",
                                               "partial"))
    assert "'partial'" in line and "none, selective, full" in line


def test_a_trial_runs_selective_checkpointing_and_records_it() -> None:
    proc = advisor("trial", "-w", "tiny-gpt2", "-H", "cpu", "--set", "checkpointing=selective", "--set", "batch_size=2",
                   "--warmup-steps", "1", "--min-steps", "2", "--min-time", "0", "--settle", "0", "--no-estimate",
                   "--record-peak", "never", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["status"] == "ok" and result["config"]["checkpointing"] == "selective", result["error"]
    line = assert_one_line_usage_error(advisor("trial", "-w", "tiny-gpt2", "-H", "cpu", "--set",
                                               "checkpointing=partial", "--no-estimate"))
    assert "checkpointing" in line and "'none', 'selective' or 'full'" in line

"""`advisor results export` and `advisor recommend` as real subprocesses on a store filled with real
TrialResults: the three export formats of a stored best or trial, the recommend table and JSON with
their provenance, and one-line errors with exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from stored_bests import GPT_ARGS, store_best

from advisor.trial import TrainingConfig

ROOT = Path(__file__).resolve().parents[2]
BEST = TrainingConfig(device="cuda", batch_size=512, precision="bf16", num_workers=2, pin_memory=True, nproc=2,
                      strategy="ddp", compile_mode="default")


@pytest.fixture(scope="module")
def filled(tmp_path_factory) -> tuple[str, Path, dict[str, int]]:
    tmp = tmp_path_factory.mktemp("rec")
    url = f"sqlite:///{tmp / 'advisor.db'}"
    ids = {"gpt": store_best(url, "a100-80gb:2", BEST, 9_000.0).id,
           "mlp": store_best(url, "cpu:1", TrainingConfig(batch_size=64), 700.0, workload="tiny-mlp", args={},
                             description={"params": 1}).id}  # no spec stored: export falls back to the name
    return url, tmp, ids


def advisor(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "ADVISOR_DATA_DIR": str(tmp / "data"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "advisor.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def test_export_json_python_and_torchrun_of_the_stored_best(filled):
    url, tmp, ids = filled
    proc = advisor(tmp, "results", "export", "--workload", "tiny-gpt2", "--hardware", "a100-80gb", "--db", url)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert TrainingConfig.model_validate(doc["config"]) == BEST
    assert doc["workload"] == {"spec": "tiny-gpt2", "args": GPT_ARGS}  # from the study's workload description
    out = tmp / "train.py"
    proc = advisor(tmp, "results", "export", "--trial", str(ids["gpt"]), "--format", "python", "--out", str(out),
                   "--db", url)
    assert proc.returncode == 0, proc.stderr
    src = out.read_text()
    compile(src, str(out), "exec")
    assert "tiny-gpt2" in src and "bfloat16" in src and "DistributedDataParallel" in src
    proc = advisor(tmp, "results", "export", "--trial", str(ids["gpt"]), "--format", "torchrun", "--db", url)
    assert proc.returncode == 0 and "torchrun" in proc.stdout and "--nproc-per-node 2" in proc.stdout


def test_export_falls_back_to_the_workload_name(filled):
    url, tmp, ids = filled
    doc = json.loads(advisor(tmp, "results", "export", "--trial", str(ids["mlp"]), "--db", url).stdout)
    assert doc["workload"] == {"spec": "tiny-mlp", "args": {}} and doc["config"]["batch_size"] == 64


@pytest.mark.parametrize("args, says", [
    (("--trial", "999"), "no trial with id 999"),
    (("--workload", "tiny-bert", "--hardware", "a100-80gb"), "no best configuration stored"),
    (("--workload", "tiny-gpt2", "--format", "yaml"), "unknown export format 'yaml'"),
    (("--trial", "1", "--workload", "tiny-gpt2"), "not both"),
    ((), "name a trial"),
])
def test_export_errors_are_one_line_with_exit_2(filled, args, says):
    url, tmp, _ = filled
    proc = advisor(tmp, "results", "export", *args, "--db", url)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and says in proc.stderr, proc.stderr


def test_recommend_json_and_table_name_the_provenance(filled):
    url, tmp, ids = filled
    args = ["recommend", "-w", "tiny-gpt2", "-a", "num_samples=100000", "-H", "a100-80gb:2", "-H", "tiny",
            "--price", "a100-80gb:2=3.5", "--db", url]
    proc = advisor(tmp, *args, "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["hardware"]: r for r in json.loads(proc.stdout)}
    assert rows["a100-80gb:2"]["provenance"] == "measured" and rows["a100-80gb:2"]["source_trial_id"] == ids["gpt"]
    assert rows["a100-80gb:2"]["cost_per_epoch"] == pytest.approx(100_000 / 9_000.0 / 3600 * 2 * 3.5)
    assert rows["tiny"]["provenance"] == "transferred" and rows["tiny"]["config"]["nproc"] == 1
    table = advisor(tmp, *args)
    assert table.returncode == 0 and "measured" in table.stdout and "transferred" in table.stdout


@pytest.mark.parametrize("args, says", [
    (("-H", "a100-80gb", "--price", "a100-80gb=cheap"), "--price 'a100-80gb=cheap'"),
    (("-H", "a100-80gb", "--price", "h100-sxm=2"), "not a candidate"),
    (("-H", "nope"), "unknown hardware 'nope'"),
])
def test_recommend_errors_are_one_line_with_exit_2(filled, args, says):
    url, tmp, _ = filled
    proc = advisor(tmp, "recommend", "-w", "tiny-gpt2", *args, "--db", url)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and says in proc.stderr, proc.stderr

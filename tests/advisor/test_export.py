"""`advisor results export`: JSON, a Python script generated from the config (it compiles for every
kind of config, and runs for real on the CPU), and the torchrun launch command."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from advisor.errors import SpecError
from advisor.export import export
from advisor.hardware import get_hardware
from advisor.trial import TrainingConfig
from search_spaces import SpaceContext, get_space, grid

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = "tiny-mlp"


def _run(src: str, tmp_path: Path, steps: int, launch: str | None = None) -> str:
    script = tmp_path / "train.py"
    script.write_text(src)
    # the checkout first, then whatever the caller's PYTHONPATH holds (where the dependencies may live)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, STEPS=str(steps), PYTHONPATH=path)
    cmd = launch or f"{sys.executable} train.py"
    proc = subprocess.run(cmd, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_json_holds_the_config_and_the_workload():
    config = TrainingConfig(batch_size=32, num_workers=2, prefetch_factor=4, precision="bf16")
    doc = json.loads(export(config, WORKLOAD, {"hidden": 64}, "json"))
    assert TrainingConfig.model_validate(doc["config"]) == config
    assert doc["workload"] == {"spec": WORKLOAD, "args": {"hidden": 64}}
    assert doc["changes"] == {"num_workers": 2, "prefetch_factor": 4, "precision": "bf16"}  # batch is in config


def _expected_fragments(c: TrainingConfig) -> list[str]:
    """Code each knob must produce in the script."""
    out = [f"BATCH_SIZE = {c.batch_size}", f"GRAD_ACCUM = {c.grad_accum}", f"num_workers={c.num_workers}",
           f"pin_memory={c.pin_memory}"]
    if c.prefetch_factor:
        out.append(f"prefetch_factor={c.prefetch_factor}")
    if c.precision.value == "fp16":
        out += ["GradScaler", "dtype=torch.float16", "scaler.scale(loss)"]
    if c.precision.value == "bf16":
        out.append("dtype=torch.bfloat16")
    if c.precision.value == "tf32":
        out.append("allow_tf32 = True")
    if c.compile_mode.value not in ("none", "default"):
        out.append(f'torch.compile(model, mode="{c.compile_mode.value}")')
    if c.optimizer_impl:
        out.append({"fused": "fused=True", "foreach": "foreach=True", "for-loop": "foreach=False"}[c.optimizer_impl])
    if c.strategy.value == "ddp":
        out.append("DDP(model, device_ids=[local_rank])" if c.device == "cuda" else "DDP(model)")
    if c.strategy.value in ("zero2", "zero3"):
        out.append(f"reshard_after_forward={c.strategy.value == 'zero3'}")
    if c.strategy.value == "zero2" and c.nproc > 1 and c.grad_accum > 1:  # gathered once a step
        out.append("model.set_reshard_after_backward(last)")
    if c.fused_backward:
        out.append("register_post_accumulate_grad_hook")
    if c.checkpointing:
        out.append({"full": "checkpoint, block.forward",
                    "selective": 'apply_activation_checkpointing(model, "selective")'}[c.checkpointing.value])
    if c.channels_last:
        out.append("memory_format=torch.channels_last")
    if c.nproc > 1:
        out += ["DistributedSampler"]
        # gloo: the GIL handed to its workers before exit (they abort the rank if it shuts down first)
        out += ['init_process_group("nccl")'] if c.device == "cuda" else ['init_process_group("gloo")', "time.sleep("]
    return out


def test_the_script_compiles_and_applies_every_knob():
    g8 = get_hardware("h100-sxm:8")
    configs = grid(get_space("default"), SpaceContext(hardware=g8, conv_net=True, device_count=8, default_batch_size=8),
                   limit=100_000)[::211]
    configs += [TrainingConfig(device="cuda", batch_size=8, checkpointing="selective", strategy="zero3", nproc=8),
                TrainingConfig(device="cuda", batch_size=8, precision="bf16-pure", compile_mode="max-autotune",
                               strategy="zero1", nproc=4, grad_accum=2, optimizer="sgd-momentum",
                               optimizer_impl="fused"),
                TrainingConfig(batch_size=8, optimizer="rowwise-adagrad", pinning="cpus", cpu_list="0-1,3", threads=2)]
    assert len(configs) > 100
    for c in configs:
        src = export(c, WORKLOAD, {}, "python")
        compile(src, "train.py", "exec")
        missing = [f for f in _expected_fragments(c) if f not in src]
        assert not missing, (c, missing)
    pinned = export(configs[-1], WORKLOAD, {}, "python")
    assert "os.sched_setaffinity(0, {0, 1, 3})" in pinned and "RowWiseAdagrad" in pinned
    zero = export(configs[-2], WORKLOAD, {}, "python")
    assert "ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD" in zero


def _losses(out: str, steps: int) -> list[float]:
    # ranks print at once, so their lines can interleave: take the number, not the rest of the word
    found = [float(x) for x in re.findall(rf"step {steps} loss (-?\d+\.\d+|nan|inf)", out)]
    assert found and all(x == x and abs(x) < 1e6 for x in found), out  # finite
    return found


def test_the_script_trains_the_workload_on_the_cpu(tmp_path):
    config = TrainingConfig(batch_size=16, num_workers=1, prefetch_factor=2, persistent_workers=True, precision="bf16",
                            optimizer_impl="foreach", checkpointing=True, threads=1, grad_accum=2)
    _losses(_run(export(config, WORKLOAD, {}, "python"), tmp_path, 3), 3)


def test_a_selective_checkpointing_script_trains_a_decoder(tmp_path):
    config = TrainingConfig(batch_size=2, checkpointing="selective", threads=1)
    src = export(config, "tiny-gpt2", {}, "python")
    assert all(f in src for f in _expected_fragments(config))
    _losses(_run(src, tmp_path, 2), 2)


def test_a_fused_backward_script_trains(tmp_path):
    config = TrainingConfig(batch_size=8, fused_backward=True, optimizer="sgd", threads=1)
    _losses(_run(export(config, WORKLOAD, {}, "python"), tmp_path, 2), 2)


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_a_data_parallel_script_trains_under_its_torchrun_command(tmp_path, strategy):
    config = TrainingConfig(batch_size=8, grad_accum=2, strategy=strategy, nproc=2)
    src = export(config, WORKLOAD, {}, "python")
    assert all(f in src for f in _expected_fragments(config))
    launch = export(config, WORKLOAD, {}, "torchrun").strip()
    assert launch == "OMP_NUM_THREADS=$(( $(nproc) / 2 )) torchrun --standalone --nnodes 1 --nproc-per-node 2 train.py"
    launch = launch.replace("torchrun", f"{sys.executable} -m torch.distributed.run")
    assert len(_losses(_run(src, tmp_path, 2, launch), 2)) == 2  # both ranks


@pytest.mark.parametrize("kw, expected", [
    (dict(device="cuda", pinning="node"), "numactl --cpunodebind=1 --membind=1 torchrun --standalone --nnodes 1 "
                                          "--nproc-per-node 1 train.py"),
    (dict(pinning="cpus", cpu_list="0-3,8", threads=4), "OMP_NUM_THREADS=4 taskset -c 0-3,8 torchrun --standalone "
                                                        "--nnodes 1 --nproc-per-node 1 train.py"),
    (dict(device="cuda", strategy="zero3", nproc=8, pinning="node"),
     "torchrun --standalone --nnodes 1 --nproc-per-node 8 --numa-binding node train.py"),
])
def test_the_launch_command(kw, expected):
    assert export(TrainingConfig(**kw), WORKLOAD, {}, "torchrun", numa_node=1).strip() == expected


@pytest.mark.parametrize("fmt", ["python", "torchrun"])
def test_a_tp_or_pp_config_is_not_exported_as_a_data_parallel_script(fmt):
    config = TrainingConfig(batch_size=8, tp=2, pp=2, nproc=4)
    with pytest.raises(SpecError, match="runs data parallel only") as info:
        export(config, "tiny-decoder", {}, fmt)
    assert "\n" not in str(info.value) and "tp2 pp2" in str(info.value)
    doc = json.loads(export(config, "tiny-decoder", {}, "json"))  # the JSON holds every knob
    assert TrainingConfig.model_validate(doc["config"]) == config


def test_the_cli_refuses_a_stored_tp_trial_with_exit_2(tmp_path):
    from stored_bests import store_best

    url = f"sqlite:///{tmp_path / 'advisor.db'}"
    trial = store_best(url, "cpu:2", TrainingConfig(batch_size=8, tp=2, nproc=2), 100.0, workload="tiny-decoder",
                       args={})
    env = {**os.environ, "ADVISOR_DATA_DIR": str(tmp_path / "data"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "advisor.cli", "results", "export", "--trial", str(trial.id),
                           "--format", "python", "--db", url], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "runs data parallel only" in proc.stderr, proc.stderr


def test_an_unknown_format_lists_the_formats():
    with pytest.raises(SpecError, match="json, python, torchrun"):
        export(TrainingConfig(), WORKLOAD, {}, "yaml")


@pytest.mark.gpu
def test_a_cuda_script_trains(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; none is visible here")
    config = TrainingConfig(device="cuda", batch_size=32, num_workers=2, prefetch_factor=2, persistent_workers=True,
                            pin_memory=True, precision="fp16", optimizer_impl="fused", compile_mode="default")
    _losses(_run(export(config, WORKLOAD, {}, "python"), tmp_path, 3), 3)

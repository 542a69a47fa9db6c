"""probes.parallel: real 2-rank gloo runs on CPU (DDP, ZeRO-1, FSDP2 zero2/zero3) against one process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from advisor.config import OptimizerKind, Precision, Strategy
from advisor.errors import TrialError
from advisor.presets import get_preset
from advisor.training import make_optimizer, prepare, train_step
from probes.parallel import (
    DistInfo,
    check_strategy,
    gathered_parameters,
    init_distributed,
    local_param_bytes,
    make_trial_optimizer,
    optimizer_state_bytes,
    param_digest,
    shutdown_distributed,
    wrap_model,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from _parallel_rank import BATCH, WORKLOAD_ARGS  # noqa: E402

SINGLE = DistInfo(rank=0, world_size=1, local_rank=0, backend=None)
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(strategy: str, kind: str, precision: str, out: Path, world_size: int = 2) -> list[dict]:
    """Start `world_size` real processes with torchrun's variables; return each rank's saved result."""
    port, procs = free_port(), []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        cmd = ["nice", "-n", "5", sys.executable, str(HERE / "_parallel_rank.py"), strategy, kind, precision, str(out)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for proc in procs:
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


class Reference(NamedTuple):
    initial: dict  # parameter name -> tensor before training
    initial_digest: str
    final: dict  # after two steps
    param_bytes: int
    state_bytes: int  # optimizer state after two steps


def reference(kind: str, precision: str, world_size: int = 2) -> Reference:
    """One process, rank 0's initial weights, all ranks' batches concatenated: what DP must equal."""
    torch.manual_seed(100)  # rank 0's init seed in _parallel_rank.py
    workload = get_preset("tiny-mlp")(**WORKLOAD_ARGS)
    model = workload.build_model()
    ctx = prepare(model, workload.loss_fn, precision=Precision(precision), optimizer=OptimizerKind(kind))
    initial, initial_digest = gathered_parameters(model), param_digest(model)
    batches = [get_preset("tiny-mlp")(seed=r, **WORKLOAD_ARGS).make_batch(BATCH) for r in range(world_size)]
    inputs = torch.cat([b[0] for b in batches]).to(next(model.parameters()).dtype)
    labels = torch.cat([b[1] for b in batches])
    for _ in range(2):
        train_step(ctx, (inputs, labels))
    return Reference(initial, initial_digest, gathered_parameters(model), local_param_bytes(model),
                     optimizer_state_bytes(ctx.optimizers[0]))


def assert_trained_like_reference(ranks: list[dict], ref: Reference, atol: float = 2e-5) -> None:
    """Ranks agree, started from rank 0's weights, moved, and match one process on all the data.

    fp32 only: two Adam-like steps move each tensor by ~2e-3, far above `atol`. Adam divides each
    gradient by its own scale, so where a gradient is near zero the rounding of a two-rank average
    against one batch's sum (another summation order) shows: up to ~1e-5 on some CPUs (AVX-512
    here), 1% of a step. A rank that skipped the all-reduce, or a wrong shard, is off by a whole step.
    """
    assert ranks[0]["final_digest"] == ranks[1]["final_digest"]
    assert [r["wrapped_digest"] for r in ranks] == [ref.initial_digest] * 2  # rank 1's own init replaced
    assert ranks[0]["final_digest"] != ref.initial_digest
    for name, value in ref.final.items():
        got = ranks[0]["params"][name].float()
        moved = (got - ref.initial[name].float()).abs().max()
        assert moved > 50 * atol, f"{name} moved only {moved}"  # the check below can tell a step from none
        torch.testing.assert_close(got, value.float(), atol=atol, rtol=1e-5, msg=name)


def test_ddp_ranks_agree_and_match_one_process_on_all_data(tmp_path: Path) -> None:
    ranks = run_ranks("ddp", "adam", "fp32", tmp_path)
    ref = reference("adam", "fp32")
    assert [(r["rank"], r["world_size"], r["backend"], r["model_type"]) for r in ranks] == \
        [(0, 2, "gloo", "DistributedDataParallel"), (1, 2, "gloo", "DistributedDataParallel")]
    assert_trained_like_reference(ranks, ref)
    # Nothing sharded: every rank holds all parameters and all optimizer state.
    assert [r["local_param_bytes"] for r in ranks] == [ref.param_bytes] * 2
    assert [r["optimizer_state_bytes"] for r in ranks] == [ref.state_bytes] * 2


def test_zero1_shards_optimizer_state_only(tmp_path: Path) -> None:
    ranks = run_ranks("zero1", "adam", "fp32", tmp_path)
    ref = reference("adam", "fp32")
    assert ranks[0]["optimizer_type"] == "ZeroRedundancyOptimizer"
    assert_trained_like_reference(ranks, ref)
    states = [r["optimizer_state_bytes"] for r in ranks]
    assert sum(states) == ref.state_bytes  # each tensor's state lives on exactly one rank
    assert all(0.4 < s / ref.state_bytes < 0.6 for s in states), states
    assert [r["local_param_bytes"] for r in ranks] == [ref.param_bytes] * 2  # parameters replicated


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_fsdp_shards_parameters_and_state(tmp_path: Path, strategy: str) -> None:
    ranks = run_ranks(strategy, "adam", "fp32", tmp_path)
    ref = reference("adam", "fp32")
    assert ranks[0]["model_type"].startswith("FSDP")
    assert_trained_like_reference(ranks, ref)
    held = [r["local_param_bytes"] for r in ranks]
    states = [r["optimizer_state_bytes"] for r in ranks]
    assert sum(held) == ref.param_bytes and all(0.45 < h / ref.param_bytes < 0.55 for h in held), held
    assert all(0.45 < s / ref.state_bytes < 0.55 for s in states), states
    # Between forward and backward zero2 keeps whole parameters, zero3 only its shards.
    expected = ref.param_bytes if strategy == "zero2" else held[0]
    assert ranks[0]["after_forward_bytes"] == [expected, expected]


def test_zero3_rowwise_adagrad_steps_dtensor_shards(tmp_path: Path) -> None:
    ranks = run_ranks("zero3", "rowwise-adagrad", "fp32", tmp_path)
    assert_trained_like_reference(ranks, reference("rowwise-adagrad", "fp32"))


def test_zero2_bf16_pure_trains_in_bf16(tmp_path: Path) -> None:
    ranks = run_ranks("zero2", "adamw", "bf16-pure", tmp_path)
    ref = reference("adamw", "bf16-pure")
    assert {v.dtype for v in ranks[0]["params"].values()} == {torch.bfloat16}
    assert sum(r["local_param_bytes"] for r in ranks) == ref.param_bytes  # 2 bytes per parameter
    assert ranks[0]["final_digest"] == ranks[1]["final_digest"] != ref.initial_digest
    # bf16 gradients reduced across ranks round differently from one process's, and Adam turns
    # a near-zero gradient's flipped sign into a whole step, so compare element counts: most
    # elements equal the one-process result exactly, while most moved from their start.
    same = sum(int((ranks[0]["params"][k] == v).sum()) for k, v in ref.final.items())
    unmoved = sum(int((ref.initial[k] == v).sum()) for k, v in ref.final.items())
    total = sum(v.numel() for v in ref.final.values())
    assert same / total > 0.75 and unmoved / total < 0.25, (same / total, unmoved / total)


def test_zero2_fp16_uses_the_sharded_scaler_and_ranks_agree(tmp_path: Path) -> None:
    ranks = run_ranks("zero2", "adam", "fp16", tmp_path)
    assert [r["scaler_type"] for r in ranks] == ["ShardedGradScaler"] * 2
    assert ranks[0]["final_digest"] == ranks[1]["final_digest"] != ranks[0]["wrapped_digest"]


def test_init_distributed_without_world_size_initialises_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in DIST_VARS:
        monkeypatch.delenv(name, raising=False)
    assert init_distributed("cpu") == SINGLE
    assert not torch.distributed.is_initialized()
    shutdown_distributed()  # nothing to destroy: must not raise


def test_init_distributed_reports_missing_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in DIST_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(TrialError, match="MASTER_ADDR is not set"):
        init_distributed("cpu")
    monkeypatch.setenv("RANK", "two")
    with pytest.raises(TrialError, match="RANK='two' is not an integer"):
        init_distributed("cpu")


def test_init_distributed_times_out_when_a_rank_never_joins(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(TrialError, match=r"rank 0/2 could not join gloo group at 127\.0\.0\.1") as err:
        init_distributed("cpu", timeout_s=2)
    assert "\n" not in str(err.value)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(("strategy", "world_size", "device", "fragment"), [
    ("single", 1, "cpu", None),
    ("single", 2, "cpu", "single runs one process"),
    ("ddp", 1, "cpu", "needs at least 2 processes"),
    ("zero1", 1, "cpu", "needs at least 2 processes"),
    ("ddp", 2, "cpu", None),
    ("zero1", 2, "cpu", None),
    ("zero2", 2, "cpu", None),  # FSDP2 on gloo trains: the 2-rank tests above run it
    ("zero3", 4, "cpu", None),
    ("ddp", 2, "mps", "not 'mps'"),
    ("ddp", 0, "cpu", "world size must be >= 1"),
])
def test_check_strategy(strategy: str, world_size: int, device: str, fragment: str | None) -> None:
    reason = check_strategy(Strategy(strategy), world_size, device)
    assert reason is None if fragment is None else fragment in reason


def test_check_strategy_cuda_needs_a_device_per_process() -> None:
    count = torch.cuda.device_count()
    reason = check_strategy(Strategy.ddp, count + 1 if count else 2, "cuda")
    expected = "CUDA devices" if torch.distributed.is_nccl_available() else "no NCCL backend"  # CPU build
    assert reason is not None and expected in reason


def test_check_strategy_refuses_what_cannot_step_shards_or_reduced_grads() -> None:
    assert "before gradients are reduced" in check_strategy(Strategy.ddp, 2, "cpu", fused_backward=True)
    assert check_strategy(Strategy.single, 1, "cpu", fused_backward=True) is None
    sgd = {"optimizer_kind": OptimizerKind.sgd_momentum, "impl": "fused"}
    assert "no DTensor support" in check_strategy(Strategy.zero3, 2, "cpu", **sgd)
    assert check_strategy(Strategy.zero1, 2, "cpu", **sgd) is None  # ZeRO-1 steps plain tensors
    assert check_strategy(Strategy.zero3, 2, "cpu", optimizer_kind=OptimizerKind.adam, impl="fused") is None
    info = SINGLE.model_copy(update={"world_size": 2, "backend": "gloo"})
    with pytest.raises(TrialError, match="fused sgd-momentum has no DTensor support"):
        make_trial_optimizer(torch.nn.Linear(2, 2), Strategy.zero2, OptimizerKind.sgd_momentum, "fused", info)


def test_single_leaves_the_model_and_optimizer_plain() -> None:
    model = get_preset("tiny-mlp")().build_model()
    digest, held = param_digest(model), local_param_bytes(model)
    assert wrap_model(model, Strategy.single, SINGLE, precision=Precision.fp32, device_type="cpu") is model
    assert param_digest(model) == digest
    assert held == 4 * sum(p.numel() for p in model.parameters())  # fp32, nothing sharded
    opt = make_trial_optimizer(model, Strategy.single, OptimizerKind.adam, "foreach", SINGLE)
    assert type(opt) is torch.optim.Adam and opt.defaults["foreach"] is True
    with torch.no_grad():
        next(model.parameters())[0, 0] += 1.0
    assert param_digest(model) != digest  # one changed value changes the digest


def test_wrap_model_refuses_a_strategy_the_world_cannot_run() -> None:
    with pytest.raises(TrialError, match="ddp needs at least 2 processes"):
        wrap_model(torch.nn.Linear(2, 2), Strategy.ddp, SINGLE, precision=Precision.fp32, device_type="cpu")


def test_optimizer_spec_matches_make_optimizer() -> None:
    from advisor.training import optimizer_spec

    cls, kwargs = optimizer_spec(OptimizerKind.sgd_momentum, "for-loop")
    opt = make_optimizer(OptimizerKind.sgd_momentum, [torch.nn.Parameter(torch.zeros(2))], "for-loop")
    assert type(opt) is cls and kwargs == {"lr": 1e-3, "momentum": 0.9, "foreach": False}
    assert opt.defaults["momentum"] == 0.9 and opt.defaults["foreach"] is False

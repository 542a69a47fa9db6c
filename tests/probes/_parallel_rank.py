"""One rank of a real data-parallel run for tests/probes/test_parallel.py (started with torchrun's env).

usage: python _parallel_rank.py STRATEGY OPTIMIZER PRECISION OUT_DIR
Each rank builds the model from its own seed (so wrapping must sync rank 0's weights), trains
two steps on its own data and saves what the test compares to OUT_DIR/rank{RANK}.pt.
"""

from __future__ import annotations

import sys

import torch

from advisor.config import OptimizerKind, Precision, Strategy
from advisor.presets import get_preset
from advisor.training import prepare, train_step
from probes.parallel import (
    gathered_parameters,
    init_distributed,
    local_param_bytes,
    make_grad_scaler,
    make_trial_optimizer,
    optimizer_state_bytes,
    param_digest,
    shutdown_distributed,
    wrap_model,
)

WORKLOAD_ARGS = {"in_features": 256, "layers": 4}  # 4 equal 256x256 blocks: ZeRO-1 can split evenly
BATCH = 8  # samples per rank per step


def main(strategy: Strategy, kind: OptimizerKind, precision: Precision, out_dir: str) -> None:
    info = init_distributed("cpu", timeout_s=30)
    workload = get_preset("tiny-mlp")(seed=info.rank, **WORKLOAD_ARGS)  # seed: this rank's data
    torch.manual_seed(100 + info.rank)  # a different init on each rank
    wrapped: list = []

    def wrap(m):
        wrapped.append(wrap_model(m, strategy, info, precision=precision, device_type="cpu"))
        return wrapped[0]

    ctx = prepare(workload.build_model(), workload.loss_fn, precision=precision, optimizer=kind, wrap=wrap,
                  make_opt=lambda m: make_trial_optimizer(m, strategy, kind, None, info))
    model = wrapped[0]
    wrapped_digest = param_digest(model)
    if ctx.scaler is not None:
        ctx.scaler = make_grad_scaler(strategy, "cpu")
    after_forward: list[int] = []  # local parameter bytes between forward and backward, per step

    def phase(name: str) -> None:
        if name == "backward":
            after_forward.append(local_param_bytes(model))

    inputs, labels = workload.make_batch(BATCH)
    for _ in range(2):
        train_step(ctx, (inputs.to(next(model.parameters()).dtype), labels), phase)
    result = {
        "rank": info.rank, "world_size": info.world_size, "backend": info.backend,
        "wrapped_digest": wrapped_digest, "final_digest": param_digest(model),
        "params": gathered_parameters(model), "local_param_bytes": local_param_bytes(model),
        "after_forward_bytes": after_forward, "optimizer_state_bytes": optimizer_state_bytes(ctx.optimizers[0]),
        "optimizer_type": type(ctx.optimizers[0]).__name__, "model_type": type(model).__name__,
        "scaler_type": type(ctx.scaler).__name__ if ctx.scaler is not None else None,
    }
    torch.save(result, f"{out_dir}/rank{info.rank}.pt")
    shutdown_distributed()


if __name__ == "__main__":
    main(Strategy(sys.argv[1]), OptimizerKind(sys.argv[2]), Precision(sys.argv[3]), sys.argv[4])

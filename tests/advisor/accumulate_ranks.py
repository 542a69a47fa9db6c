"""Four gloo ranks (dp 2 zero3 x pp 2) take one optimizer step of a batch of 8 samples per replica (4 micro-batches
of 2) and, again from the same weights, one step accumulating two batches of 4 (2 micro-batches each, losses scaled
by 1/2): each rank prints the largest difference of the two updates, relative to its largest update, and that
update. Run by tests/advisor/test_layouts.py."""

from __future__ import annotations

import torch

SHAPE = {"layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 256, "seq_len": 32}


def _update(workload, layout, rank: int, batch, grad_accum: int) -> dict[str, torch.Tensor]:
    """Each parameter's change (whole) over one optimizer step of `batch` in `grad_accum` micro-steps."""
    from advisor.config import OptimizerKind, Precision
    from advisor.parallel.program import build_program

    torch.manual_seed(1)
    size = len(batch[0]) // grad_accum
    program = build_program(workload, layout, rank=rank, device_type="cpu", device=torch.device("cpu"),
                            precision=Precision.fp32, optimizer=OptimizerKind.sgd, batch_size=size)

    def whole() -> dict[str, torch.Tensor]:
        return {n: p.detach().full_tensor().clone() for n, p in program.model.named_parameters()}

    before = whole()
    for i in range(grad_accum):
        part = tuple(t[i * size:(i + 1) * size] for t in batch)
        program.step(part, loss_scale=1 / grad_accum, optimizer_step=i == grad_accum - 1)
    return {n: before[n] - p for n, p in whole().items()}


def updates(rank: int, world: int) -> str:
    from advisor.parallel.layout import Layout
    from advisor.workload import load_workload

    workload = load_workload("decoder", SHAPE)
    one, two = Layout(dp=2, pp=2, strategy="zero3", microbatches=4), Layout(dp=2, pp=2, strategy="zero3")
    torch.manual_seed(10 + one.coords(rank)["dp"])  # each replica its own samples
    batch = workload.make_batch(8)
    a, b = _update(workload, one, rank, batch, 1), _update(workload, two, rank, batch, 2)
    largest = max(float(a[n].abs().max()) for n in a)
    error = max(float((a[n] - b[n]).abs().max()) for n in a) / max(largest, 1e-30)
    return f"{error} {largest}"


if __name__ == "__main__":
    from tests.advisor.gloo_ranks import run_ranks

    print(" ".join(run_ranks(updates, 4)))

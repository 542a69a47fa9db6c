"""Four gloo ranks train from the same weights twice and compare the updates. dp 2 zero3 x pp 2: one optimizer step
of 8 samples per replica (4 micro-batches of 2) against one step accumulating two batches of 4 (losses scaled by
1/2). dp 4: two optimizer steps, each accumulating three batches, under zero2 (its parameters kept gathered from
batch to batch) against zero3 (which gathers them for every batch). Each rank prints, for each pair, the largest
difference of the two updates relative to its largest update, and that update. Run by
tests/advisor/test_layouts.py."""

from __future__ import annotations

import torch

SHAPE = {"layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 256, "seq_len": 32}


def _update(workload, layout, rank: int, batch, grad_accum: int, steps: int = 1) -> dict[str, torch.Tensor]:
    """Each parameter's change (whole) over `steps` optimizer steps of `batch`, each in `grad_accum` micro-steps."""
    from advisor.config import OptimizerKind, Precision
    from advisor.parallel.program import build_program

    torch.manual_seed(1)
    size = len(batch[0]) // grad_accum
    program = build_program(workload, layout, rank=rank, device_type="cpu", device=torch.device("cpu"),
                            precision=Precision.fp32, optimizer=OptimizerKind.sgd, batch_size=size)

    def whole() -> dict[str, torch.Tensor]:
        return {n: p.detach().full_tensor().clone() for n, p in program.model.named_parameters()}

    before = whole()
    for _ in range(steps):
        for i in range(grad_accum):
            part = tuple(t[i * size:(i + 1) * size] for t in batch)
            program.step(part, loss_scale=1 / grad_accum, optimizer_step=i == grad_accum - 1)
    return {n: before[n] - p for n, p in whole().items()}


def _compared(workload, first: tuple, second: tuple, rank: int, samples: int, steps: int = 1) -> str:
    """`first` and `second`: (layout, grad_accum) each."""
    torch.manual_seed(10 + first[0].coords(rank)["dp"])  # each replica its own samples
    batch = workload.make_batch(samples)
    a, b = (_update(workload, layout, rank, batch, k, steps) for layout, k in (first, second))
    largest = max(float(a[n].abs().max()) for n in a)
    error = max(float((a[n] - b[n]).abs().max()) for n in a) / max(largest, 1e-30)
    return f"{error} {largest}"


def updates(rank: int, world: int) -> str:
    from advisor.parallel.layout import Layout
    from advisor.workload import load_workload

    workload = load_workload("decoder", SHAPE)
    pipelined = _compared(workload, (Layout(dp=2, pp=2, strategy="zero3", microbatches=4), 1),
                          (Layout(dp=2, pp=2, strategy="zero3"), 2), rank, 8)
    kept = _compared(workload, (Layout(dp=4, strategy="zero3"), 3), (Layout(dp=4, strategy="zero2"), 3), rank, 6,
                     steps=2)
    return f"{pipelined} {kept}"


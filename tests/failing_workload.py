"""A small MLP workload whose code fails in a chosen way (`-a mode=...`), for the isolation tests.

abort: os.abort() in the loss; hang: the loss sleeps forever; raise: the loss raises RuntimeError;
exit: the loss calls sys.exit(3); hog: build_model allocates real memory until the memory cap kills it
(bytes, not tensors: tensors are fake while the estimator traces); ok: trains. exiting_workload.py
exits at import. The functions below the workload are calls the tests run in isolated workers.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from advisor import Workload

HOG_CHUNK = 64 << 20  # bytes allocated, and written, per step of the hog's loop


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def build(mode: str = "ok") -> Workload:
    def loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        if mode == "abort":
            os.abort()
        if mode == "hang":
            time.sleep(10**6)
        if mode == "raise":
            raise RuntimeError("the loss failed on purpose")
        if mode == "exit":
            sys.exit(3)
        return torch.nn.functional.cross_entropy(model(x), y)

    def model() -> torch.nn.Module:
        if mode == "hog":
            hoard = []
            while True:
                hoard.append(b"x" * HOG_CHUNK)
        return _mlp()

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 32), torch.randint(0, 4, (n,))

    return Workload(name=f"failing-{mode}", build_model=model, make_batch=make_batch, loss_fn=loss)


def one_step(spec: str, args: dict, batch_size: int) -> float:
    """One real training step of `spec` (forward, loss, backward), its stage reported; the loss's value."""
    from advisor.estimate.stages import report
    from advisor.workload import load_workload

    wl = load_workload(spec, args)
    report(f"one real step at batch {batch_size}")
    model = wl.build_model()
    loss = wl.loss_fn(model, wl.make_batch(batch_size))
    loss.backward()
    return float(loss)


def pid_after(seconds: float) -> tuple[int, float, float]:
    """(this process's pid, when the call started, when it ended): a call that holds its worker `seconds`."""
    started = time.time()
    time.sleep(seconds)
    return os.getpid(), started, time.time()

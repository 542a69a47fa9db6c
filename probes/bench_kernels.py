"""Timed kernels for the machine bench: square matmuls, large copies, host-to-device copies.

Every measurement runs one untimed warm-up, then timed runs until its time budget is spent
(at least `MIN_RUNS`), and keeps the fastest: the machine is shared, and interference only
ever slows a run down. CUDA runs are timed with CUDA events on the current stream; CPU runs
with perf_counter.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

from advisor.bench_result import CopyBench, MatmulBench

MIN_RUNS, MAX_RUNS = 2, 20
COPY_BYTES = {"cpu": 256 << 20, "cuda": 1 << 30}  # >= 256 MiB: far beyond any cache
_MAX_SIZE = {"cpu": 8192, "cuda": 16384}  # largest n before a run repeats matmuls instead
_DTYPES = {"fp32": "float32", "tf32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def timer(device: str) -> Callable[[Callable[[], Any]], float]:
    """A function timing one call of `fn` on `device` (seconds), the device synchronized at both edges."""
    import torch

    if device == "cpu":
        def cpu_time(fn: Callable[[], Any]) -> float:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start

        return cpu_time

    def cuda_time(fn: Callable[[], Any]) -> float:
        with torch.cuda.device(device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3  # elapsed_time is in ms

    return cuda_time


def _best_of(time_one: Callable[[Callable[[], Any]], float], fn: Callable[[], Any],
             budget_s: float) -> tuple[float, int]:
    """Warm up once, then time `fn` until `budget_s` is spent (MIN_RUNS..MAX_RUNS runs): (fastest s, runs)."""
    time_one(fn)
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < MIN_RUNS or (len(times) < MAX_RUNS and time.perf_counter() < deadline):
        times.append(time_one(fn))
    return min(times), len(times)


def matmul_dtypes(device: str) -> tuple[list[str], list[str]]:
    """(dtypes to measure on `device`, notes on those left out)."""
    import torch

    if device == "cpu":
        return ["fp32", "bf16", "fp16"], []
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return ["fp32", "tf32", "bf16", "fp16"], []
    return ["fp32", "tf32", "fp16"], [f"{device}: bf16 not measured (not supported natively by this GPU)"]


def bench_matmul(device: str, dtype: str, budget_s: float) -> MatmulBench:
    """Square matmul TFLOP/s of `dtype` on `device` within about `budget_s` seconds."""
    kind = device.split(":")[0]
    target = min(max(budget_s / (MIN_RUNS + 2), 0.02), 0.5)  # one run ~0.2-0.5 s at the default budget
    time_one = timer(device)
    with _cuda_fp32_math("tf32" if dtype == "tf32" else "ieee", enabled=kind == "cuda"):
        size, reps = _pick_size(time_one, device, _DTYPES[dtype], target, _MAX_SIZE[kind])
        a, b = _operands(size, device, _DTYPES[dtype])
        best, runs = _best_of(time_one, lambda: _mm(a, b, reps), budget_s)
    return MatmulBench(device=device, dtype=dtype, size=size, reps=reps, runs=runs, seconds_per_run=best,
                       tflops=2 * size**3 * reps / best / 1e12)


@contextlib.contextmanager
def _cuda_fp32_math(precision: str, enabled: bool) -> Iterator[None]:
    """cuBLAS fp32 matmuls in `precision` ('ieee': full fp32, 'tf32') inside the block."""
    if not enabled:
        yield
        return
    import torch

    matmul = torch.backends.cuda.matmul
    previous = matmul.fp32_precision  # the new API only: torch refuses a mix with allow_tf32
    matmul.fp32_precision = precision
    try:
        yield
    finally:
        matmul.fp32_precision = previous


def _operands(n: int, device: str, dtype: str) -> tuple[Any, Any]:
    import torch

    # Drawn on the device: 2 x 16384^2 floats would take seconds on the host.
    g = torch.Generator(device=device).manual_seed(0)
    a, b = torch.randn(2, n, n, generator=g, device=device).to(getattr(torch, dtype))
    return a, b


def _mm(a: Any, b: Any, reps: int) -> None:
    for _ in range(reps):
        a @ b


def _pick_size(time_one: Callable, device: str, dtype: str, target_s: float, max_size: int) -> tuple[int, int]:
    """(n, reps) so that one run of reps x (n x n @ n x n) takes about `target_s` seconds.

    Doubles n from 128 until a run takes an eighth of the target, then scales n by the cube
    root of the remaining ratio (capped at twice the last size tried: small dtypes scale worse
    than n^3 on some CPUs). At `max_size`, repeats the matmul instead of growing it.
    """
    n, reps = 128, 1
    while True:
        a, b = _operands(n, device, dtype)
        # Best of three: the first matmul of a process starts thread pools and loads kernels,
        # and on a shared machine a preempted tiny run would stop the growth far too early.
        seconds = min(time_one(lambda: _mm(a, b, reps)) for _ in range(3))
        if seconds >= target_s / 8:
            break
        if n < max_size:
            n *= 2
        else:
            reps *= 8
    grow = (target_s / seconds) ** (1 / 3)
    if n >= max_size:
        return n, max(1, round(reps * grow**3))
    return max(64, min(int(n * grow) // 64 * 64, 2 * n, max_size)), reps


def bench_copy(device: str, budget_s: float) -> CopyBench:
    """Bandwidth of `dst.copy_(src)` between two large tensors on `device` (read + write counted)."""
    import torch

    nbytes = COPY_BYTES[device.split(":")[0]]
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)  # touched: no page faults in the copies
    dst = torch.empty_like(src)
    best, runs = _best_of(timer(device), lambda: dst.copy_(src), budget_s)
    return CopyBench(device=device, kind="copy", tensor_bytes=nbytes, bytes_counted=2 * nbytes, runs=runs,
                     seconds_per_copy=best, gb_per_s=2 * nbytes / best / 1e9)


def bench_host_to_device(device: str, budget_s: float) -> list[CopyBench]:
    """Host-to-`device` bandwidth from page-locked and from ordinary (pageable) host memory."""
    import torch

    nbytes = COPY_BYTES["cpu"]
    dst = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    results = []
    for kind in ("h2d-pinned", "h2d-pageable"):
        src = torch.ones(nbytes // 4, dtype=torch.float32)
        if kind == "h2d-pinned":
            src = src.pin_memory()
        best, runs = _best_of(timer(device), lambda: dst.copy_(src, non_blocking=True), budget_s / 2)
        results.append(CopyBench(device=device, kind=kind, tensor_bytes=nbytes, bytes_counted=nbytes, runs=runs,
                                 seconds_per_copy=best, gb_per_s=nbytes / best / 1e9))
    return results

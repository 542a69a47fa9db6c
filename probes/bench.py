"""Measure this machine for `advisor probe --bench`: matmul TFLOP/s, memory and host-to-device
bandwidth, and a DataLoader throughput curve over worker counts, within a time budget."""

from __future__ import annotations

import os
import time
from typing import Any

from advisor.bench_result import BenchResult, CopyBench, LoaderCurve, LoaderPoint, MatmulBench
from advisor.errors import SpecError

__all__ = ["BenchResult", "DEFAULT_SECONDS", "DEFAULT_WORKLOAD", "bench_loader", "run_bench", "worker_counts"]

DEFAULT_WORKLOAD = "tiny-resnet"
DEFAULT_SECONDS = 10.0  # measuring time; setup (imports, allocation, worker start) adds a few seconds
# Shares of the budget: matmuls, memory copies (device and host-to-device), the DataLoader curve.
_SHARE = {"matmul": 0.35, "memory": 0.15, "loader": 0.5}
_MAX_BATCHES = 500


def worker_counts(cpus: int) -> list[int]:
    """0, 1, 2, 4, ... doubling, and `cpus` itself: [0, 1, 2] on 2 CPUs, [0, 1, 2, 4, 6] on 6."""
    counts, n = [0], 1
    while n < cpus:
        counts.append(n)
        n *= 2
    return counts + [cpus]


def run_bench(workload: str = DEFAULT_WORKLOAD, *, workload_args: dict[str, Any] | None = None,
              seconds: float = DEFAULT_SECONDS) -> BenchResult:
    """Measure the CPU and every visible CUDA device in about `seconds` (plus setup).

    The workload is loaded first, so a bad name or argument fails (SpecError) before anything runs.
    """
    if not seconds > 0:
        raise SpecError(f"bench seconds must be positive, got {seconds!r}")
    from advisor.workload import load_workload

    started = time.perf_counter()
    wl = load_workload(workload, workload_args)
    if wl.dataset is None:
        raise SpecError(f"workload {wl.name!r} has no dataset; the DataLoader bench needs one (e.g. tiny-resnet)")
    import torch

    devices = ["cpu", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
    matmul, notes = _bench_matmuls(devices, seconds * _SHARE["matmul"])
    memory, h2d, h2d_note = _bench_memory(devices, seconds * _SHARE["memory"])
    usable = len(os.sched_getaffinity(0))
    loader = bench_loader(wl, worker_counts(usable), seconds * _SHARE["loader"])
    return BenchResult(torch_threads=torch.get_num_threads(), usable_cpus=usable, matmul=matmul, memory=memory,
                       host_to_device=h2d, host_to_device_note=h2d_note, loader=loader, budget_seconds=seconds,
                       seconds=time.perf_counter() - started, notes=notes)


def _bench_matmuls(devices: list[str], budget_s: float) -> tuple[list[MatmulBench], list[str]]:
    from probes.bench_kernels import bench_matmul, matmul_dtypes

    plan: list[tuple[str, str]] = []
    notes: list[str] = []
    for device in devices:
        dtypes, skipped = matmul_dtypes(device)
        plan += [(device, dtype) for dtype in dtypes]
        notes += skipped
    results = []
    for device, dtype in plan:
        try:
            results.append(bench_matmul(device, dtype, budget_s / len(plan)))
        except RuntimeError as err:  # a dtype this build has no kernel for on this device
            notes.append(f"{device}: {dtype} matmul not measured ({str(err).splitlines()[0]})")
    return results, notes


def _bench_memory(devices: list[str], budget_s: float) -> tuple[list[CopyBench], list[CopyBench], str | None]:
    from probes.bench_kernels import bench_copy, bench_host_to_device

    cuda = [d for d in devices if d.startswith("cuda")]
    share = budget_s / (len(devices) + len(cuda))  # one slot per device copy, one per host-to-device pair
    memory = [bench_copy(device, share) for device in devices]
    h2d = [result for device in cuda for result in bench_host_to_device(device, share)]
    return memory, h2d, None if cuda else "no CUDA device"


def bench_loader(workload: Any, counts: list[int], budget_s: float) -> LoaderCurve:
    """Samples/s of the workload's DataLoader at each worker count, over the same number of batches.

    That number comes from batches 2-4 at 0 workers, so that the 0-worker point takes about
    `budget_s` / len(counts). The first batch of every count is excluded (worker start-up,
    first-use caches). A count still running at twice its share (workers slower than the main
    process, or a busy machine) stops there and reports the batches it timed.
    """
    dataset = workload.dataset()
    batch, share = workload.default_batch_size, budget_s / len(counts)
    _, calibration_s = _time_loader(dataset, workload.collate_fn, batch, 0, 3, deadline_s=share)
    batches = max(4, min(_MAX_BATCHES, int(share / (calibration_s / 3))))
    points = []
    for workers in counts:
        timed, seconds = _time_loader(dataset, workload.collate_fn, batch, workers, batches, deadline_s=2 * share)
        points.append(LoaderPoint(workers=workers, batches=timed, seconds=seconds,
                                  samples_per_s=timed * batch / seconds))
    return LoaderCurve(workload=workload.name, batch_size=batch, batches=batches, points=points)


def _time_loader(dataset: Any, collate_fn: Any, batch: int, workers: int, batches: int,
                 deadline_s: float) -> tuple[int, float]:
    """(batches timed, their seconds) of a fresh DataLoader: up to `batches` after the first, within `deadline_s`."""
    from torch.utils.data import DataLoader

    # Indices cycle over the dataset, so a small dataset still yields every batch asked for.
    indices = [i % len(dataset) for i in range((batches + 1) * batch)]
    loader = DataLoader(dataset, batch_size=batch, sampler=indices, num_workers=workers, collate_fn=collate_fn)
    it = iter(loader)
    next(it)
    first = time.perf_counter()
    timed = 0
    while timed < batches and (timed < 4 or time.perf_counter() - first < deadline_s):
        next(it)
        timed += 1
    end = time.perf_counter()
    del it  # shuts the workers down before the next count starts its own
    return timed, end - first

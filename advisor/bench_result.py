"""What `advisor probe --bench` measured, as typed results (units in every field's description)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class MatmulBench(BaseModel):
    """Square matmul throughput of one dtype on one device: `reps` x (size x size) @ (size x size) per run."""

    model_config = _FROZEN

    device: str = Field(description="'cpu' or 'cuda:<index>'.")
    dtype: Literal["fp32", "tf32", "bf16", "fp16"] = Field(description="Operand dtype; tf32 is fp32 with TF32 math.")
    size: int = Field(gt=0, description="n of the n x n operands (elements per side).")
    reps: int = Field(gt=0, description="Matmuls back to back in one timed run.")
    runs: int = Field(gt=0, description="Timed runs after one untimed warm-up run at this size.")
    seconds_per_run: float = Field(gt=0, description="Fastest timed run (seconds).")
    tflops: float = Field(gt=0, description="2 n^3 reps / seconds_per_run / 1e12 (TFLOP/s).")


class CopyBench(BaseModel):
    """Bandwidth of one kind of large copy, from the fastest of several timed copies."""

    model_config = _FROZEN

    device: str = Field(description="Where the destination lives: 'cpu' or 'cuda:<index>'.")
    kind: Literal["copy", "h2d-pinned", "h2d-pageable"] = Field(
        description="'copy': tensor.copy_ within the device's memory; 'h2d-*': host tensor (page-locked "
        "or ordinary) to device memory."
    )
    tensor_bytes: int = Field(gt=0, description="Size of the copied tensor (bytes).")
    bytes_counted: int = Field(
        gt=0, description="Bytes moved per copy: read + write (2 x tensor_bytes) for 'copy', tensor_bytes for h2d."
    )
    runs: int = Field(gt=0, description="Timed copies after one untimed warm-up copy.")
    seconds_per_copy: float = Field(gt=0, description="Fastest timed copy (seconds).")
    gb_per_s: float = Field(gt=0, description="bytes_counted / seconds_per_copy / 1e9 (GB/s, decimal).")


class LoaderPoint(BaseModel):
    """DataLoader throughput with one number of workers."""

    model_config = _FROZEN

    workers: int = Field(ge=0, description="num_workers (0: batches are made in the main process).")
    batches: int = Field(gt=0, description="Batches timed after the first; fewer than planned if time ran out.")
    seconds: float = Field(gt=0, description="Wall time of the timed batches, first batch excluded (seconds).")
    samples_per_s: float = Field(gt=0, description="Samples delivered per second over the timed batches.")


class LoaderCurve(BaseModel):
    """DataLoader throughput over worker counts for one workload's dataset."""

    model_config = _FROZEN

    workload: str = Field(description="The workload whose dataset and collate_fn were read.")
    batch_size: int = Field(gt=0, description="Samples per batch (the workload's default batch).")
    batches: int = Field(gt=0, description="Batches planned per worker count, after a first (warm-up) batch.")
    points: list[LoaderPoint] = Field(description="One point per worker count, in increasing order.")


class BenchResult(BaseModel):
    """Measured speeds of this machine: matmuls, memory copies, host-to-device copies, data loading."""

    model_config = _FROZEN

    torch_threads: int = Field(gt=0, description="torch intra-op threads used by the CPU measurements.")
    usable_cpus: int = Field(gt=0, description="CPUs this process may run on (sched_getaffinity).")
    matmul: list[MatmulBench] = Field(description="Per device and dtype; dtypes a device cannot run are in notes.")
    memory: list[CopyBench] = Field(description="Large copy within each device's memory ('copy').")
    host_to_device: list[CopyBench] = Field(description="Pinned and pageable host-to-device copies per CUDA device.")
    host_to_device_note: str | None = Field(default=None, description="Why host_to_device is empty ('no CUDA device').")
    loader: LoaderCurve
    budget_seconds: float = Field(gt=0, description="Time the measurements were asked to take (seconds).")
    seconds: float = Field(gt=0, description="Time the whole bench took, setup included (seconds).")
    notes: list[str] = Field(default_factory=list, description="Anything skipped, and why.")

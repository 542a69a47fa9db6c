"""Measured peak memory of (workload, device, configuration) points: what refines the estimator.

A CUDA trial records its own peak (`record_measured_peak`); a CPU trial the fresh-process run of
docs/design.md's protocol it makes after itself (probes/protocol.py), and a CPU calibration each of its
fresh-process runs (`record_points`). `estimate_memory` reads the points of the same workload, device and
memory knobs: on CUDA a shift or an affine fit in the batch size, on the CPU more runs of its
resident-set fit (advisor/estimate/refine.py says why). The store is a small interface with a
JSON-lines implementation under `data_dir/calibration`.
"""

from __future__ import annotations

import fcntl
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from advisor.config import Checkpointing
from advisor.errors import SpecError, StoreError
from advisor.estimate.model import EstimateRequest
from advisor.fingerprint import config_key, workload_fingerprint
from advisor.hardware.spec import HardwareSpec
from advisor.workload import Workload, WorkloadInfo

Quantity = Literal["cpu_rss", "cuda_allocated", "cuda_reserved"]


class PeakPoint(BaseModel):
    """One measured peak: a workload on a device with one configuration at one batch size."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fingerprint: str = Field(description="advisor.fingerprint.workload_fingerprint of the workload.")
    device: str = Field(description="Device key: 'cpu' (this host) or the accelerator's catalog name.")
    world_size: int = Field(gt=0, description="Processes/devices the step ran on.")
    precision: str
    optimizer: str
    strategy: str
    checkpointing: Checkpointing
    fused_backward: bool
    optimizer_impl: str | None = None
    offload_optimizer: bool = False
    offload_params: bool = False
    compile_mode: str = Field(default="none", description="torch.compile mode, 'none' for eager.")
    quantity: Quantity = Field(
        description="Which measured peak of docs/design.md: cpu_rss, cuda_allocated, cuda_reserved.")
    batch_size: int = Field(gt=0, description="Micro-batch per device (samples).")
    peak_bytes: int = Field(ge=0, description="The measured peak (bytes).")
    predicted_bytes: int | None = Field(default=None, ge=0, description="The estimator's prediction at this point, "
                                        "when it was measured (bytes); kept for the record, not used by the fit.")
    mmap_threshold: int | None = Field(
        default=None, gt=0, description="cpu_rss: the glibc mmap threshold the run fixed (bytes; a calibration "
        "run standing in for a larger batch, advisor.estimate.resident.threshold.run_mmap_threshold); None: glibc's "
        "default.")

    @property
    def key(self) -> str:
        return point_key(self.fingerprint, self.device, self.knobs)

    @property
    def knobs(self) -> dict[str, object]:
        return self.model_dump(exclude={"fingerprint", "device", "batch_size", "peak_bytes", "predicted_bytes",
                                        "mmap_threshold"})


def point_key(fingerprint: str, device: str, knobs: dict[str, object]) -> str:
    """The key of a point's knobs; checkpointing enters as `Checkpointing.legacy`, so points kept with the boolean
    knob keep their keys."""
    if isinstance(knobs.get("checkpointing"), Checkpointing):
        knobs = {**knobs, "checkpointing": knobs["checkpointing"].legacy}
    return config_key(fingerprint, device, knobs)


def request_key(fingerprint: str, hardware: HardwareSpec, request: EstimateRequest, compile_mode: str,
                quantity: str) -> str:
    """The key `record_points` files a request's points under on `hardware` (PeakPoint.key)."""
    return point_key(fingerprint, device_key(hardware), request_knobs(request, hardware.world_size, compile_mode,
                                                                      quantity))


def device_key(hw: HardwareSpec) -> str:
    """'cpu:<model>' for a probed CPU ('cpu' where the model is unknown), else the accelerator's catalog
    name: measured peaks carry over between devices of one model, not between models (a data dir
    moved to another host keeps its points apart)."""
    if hw.device_type == "cpu":
        return f"cpu:{hw.accelerator.cpu.model_name}" if hw.accelerator.cpu is not None else "cpu"
    return hw.accelerator.name


def request_knobs(req: EstimateRequest, world_size: int, compile_mode: str, quantity: str) -> dict[str, object]:
    """The knobs of a PeakPoint (everything in its key but the workload and device) for a request."""
    return {"world_size": world_size, "precision": req.precision.value, "optimizer": req.optimizer.value,
            "strategy": req.strategy.value, "checkpointing": req.checkpointing, "fused_backward": req.fused_backward,
            "optimizer_impl": req.optimizer_impl, "offload_optimizer": req.offload_optimizer,
            "offload_params": req.offload_params, "compile_mode": compile_mode, "quantity": quantity}


class MeasuredPeaks(ABC):
    """Where measured peaks live. `add` keeps a point; `points(key)` returns every point whose
    `PeakPoint.key` equals `key`, oldest first. Both raise StoreError when the store is unusable."""

    @abstractmethod
    def add(self, point: PeakPoint) -> None: ...

    @abstractmethod
    def points(self, key: str) -> list[PeakPoint]: ...

    def may_hold_points(self) -> bool:
        """False only when the store is surely empty (lets callers skip fingerprinting)."""
        return True

    def version(self) -> object:
        """A value that changes whenever a point is added, for caches of estimates that read points;
        None where the store cannot tell (such caches then keep what they have)."""
        return None


class JsonlPeaks(MeasuredPeaks):
    """One JSON object per line in `directory/peaks.jsonl`; appends are locked (flock), so trials in
    several processes can record at once."""

    def __init__(self, directory: Path | str) -> None:
        self.path = Path(directory) / "peaks.jsonl"

    def add(self, point: PeakPoint) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                f.write(point.model_dump_json() + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise StoreError(f"cannot append to {self.path}: {exc}") from exc

    def points(self, key: str) -> list[PeakPoint]:
        if not self.path.exists():
            return []
        try:
            with open(self.path, encoding="utf-8") as f:
                fcntl.flock(f, fcntl.LOCK_SH)
                lines = f.read().splitlines()
        except OSError as exc:
            raise StoreError(f"cannot read {self.path}: {exc}") from exc
        out = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                p = PeakPoint.model_validate_json(line)
            except ValidationError as exc:
                raise StoreError(f"{self.path} line {n} is not a measured peak: {str(exc).splitlines()[0]}") from exc
            if p.key == key:
                out.append(p)
        return out

    def may_hold_points(self) -> bool:
        return self.path.exists() and self.path.stat().st_size > 0

    def version(self) -> object:
        try:  # appends only: the size grows with every point
            return self.path.stat().st_size
        except OSError:
            return 0


def default_peaks() -> MeasuredPeaks:
    from advisor.settings import get_settings

    return JsonlPeaks(get_settings().data_dir / "calibration")


def record_measured_peak(workload: Workload | WorkloadInfo, hardware: HardwareSpec, request: EstimateRequest,
                         compile_mode: str, peak_bytes: int, quantity: str, predicted_bytes: int | None,
                         store: MeasuredPeaks | None = None) -> PeakPoint:
    """Keep one measured peak of a trial (called by the trial runner after a measured trial)."""
    fingerprint = workload.fingerprint if isinstance(workload, WorkloadInfo) else workload_fingerprint(workload)
    return record_points(fingerprint, hardware, request, compile_mode, quantity,
                         [(request.batch_size, peak_bytes, predicted_bytes, None)], store)[0]


def record_points(fingerprint: str, hardware: HardwareSpec, request: EstimateRequest, compile_mode: str, quantity: str,
                  runs: list[tuple[int, int, int | None, int | None]],
                  store: MeasuredPeaks | None = None) -> list[PeakPoint]:
    """Keep measured peaks of one configuration: (batch size, peak bytes, predicted bytes or None, the glibc
    mmap threshold the run fixed or None) each."""
    knobs = request_knobs(request, hardware.world_size, compile_mode, quantity)
    try:
        points = [PeakPoint(fingerprint=fingerprint, device=device_key(hardware), batch_size=b, peak_bytes=peak,
                            predicted_bytes=predicted, mmap_threshold=t, **knobs) for b, peak, predicted, t in runs]
    except ValidationError as exc:
        err = exc.errors()[0]
        raise SpecError(f"not a valid measured peak: {'.'.join(map(str, err['loc']))}: {err['msg']}") from exc
    store = store or default_peaks()
    for point in points:
        store.add(point)
    return points

"""Probe this machine: its NVIDIA GPUs and their topology (NVML), CPUs, NUMA nodes and memory.

`probe_local()` never fails for lack of GPUs: where NVML is missing or unusable it describes
the CPU side only and says why in `note`.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import Field

from advisor.hardware.nvml import GpuInfo, NvmlReader, NvmlSnapshot
from advisor.hardware.sysinfo import (
    CpuInfo,
    HostInfo,
    NumaNode,
    format_cpulist,
    local_cpulist_for_pci,
    probe_host,
)

__all__ = [
    "CpuInfo",
    "GpuInfo",
    "LocalProbe",
    "NumaNode",
    "format_topology",
    "local_cpulist_for_pci",
    "probe_local",
    "visible_gpu_indices",
]

_CPU_ONLY = "describing the CPU only"


class LocalProbe(HostInfo):
    """Everything the probe found on this machine (HostInfo's CPU/NUMA/memory fields, plus GPUs)."""

    nvml_available: bool = Field(description="NVML initialised and answered.")
    note: str = Field(description="One line: what was found, or why the GPUs could not be described.")
    gpus: list[GpuInfo] = Field(default_factory=list, description="Every GPU NVML lists, in NVML order.")
    topology: list[list[str]] = Field(
        default_factory=list, description="GPU x GPU link labels, as `nvidia-smi topo -m` prints them."
    )
    cuda_visible_devices: str | None = Field(default=None, description="CUDA_VISIBLE_DEVICES when probed.")
    visible_gpus: list[int] = Field(
        default_factory=list, description="NVML indices of the GPUs CUDA will use here, in CUDA's order."
    )


def probe_local(nvml: Any = None) -> LocalProbe:
    """Probe this machine. `nvml` defaults to `pynvml` (imported here, lazily); tests may pass a stand-in."""
    host = probe_host()
    snapshot, note = _probe_gpus(nvml, host.numa_nodes)
    cuda_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = snapshot.gpus if snapshot else []
    return LocalProbe(
        **host.model_dump(),
        nvml_available=snapshot is not None,
        note=note,
        gpus=gpus,
        topology=snapshot.topology if snapshot else [],
        cuda_visible_devices=cuda_visible,
        visible_gpus=visible_gpu_indices(cuda_visible, gpus),
    )


def _probe_gpus(nvml: Any, numa: list[NumaNode]) -> tuple[NvmlSnapshot | None, str]:
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as err:
            return None, f"NVML not available (nvidia-ml-py is not installed: {err}): {_CPU_ONLY}"
    try:
        snapshot = NvmlReader(nvml, numa).read()
    except nvml.NVMLError as err:
        if getattr(err, "value", None) == nvml.NVML_ERROR_LIBRARY_NOT_FOUND:
            reason = "libnvidia-ml.so not found"
        else:
            reason = f"NVML error: {err}"
        return None, f"NVML not available ({reason}): {_CPU_ONLY}"
    if not snapshot.gpus:
        return snapshot, f"NVML (driver {snapshot.driver_version}) lists no GPUs: {_CPU_ONLY}"
    names = sorted({gpu.name for gpu in snapshot.gpus})
    return snapshot, f"{len(snapshot.gpus)} GPU(s) via NVML, driver {snapshot.driver_version}: {', '.join(names)}"


def visible_gpu_indices(cuda_visible_devices: str | None, gpus: list[GpuInfo]) -> list[int]:
    """NVML indices of the GPUs CUDA exposes under CUDA_VISIBLE_DEVICES, in CUDA's order.

    Unset: all GPUs. Otherwise comma-separated entries, each an index or a (prefix of a)
    'GPU-…' UUID; as in CUDA, the first entry that names no GPU (or repeats one) hides itself
    and everything after it, so '' and '-1' hide every GPU. Integer entries are read as NVML
    (PCI bus) order, which is CUDA's order under CUDA_DEVICE_ORDER=PCI_BUS_ID and, for
    identical GPUs, under CUDA's default too. MIG instance entries are not mapped.
    """
    if cuda_visible_devices is None:
        return [gpu.index for gpu in gpus]
    visible: list[int] = []
    for entry in cuda_visible_devices.split(","):
        index = _gpu_for_entry(entry.strip(), gpus)
        if index is None or index in visible:
            break
        visible.append(index)
    return visible


def _gpu_for_entry(entry: str, gpus: list[GpuInfo]) -> int | None:
    if entry.isdigit():
        wanted = int(entry)
        return wanted if any(gpu.index == wanted for gpu in gpus) else None
    if entry.lower().startswith("gpu-"):
        hits = [gpu.index for gpu in gpus if gpu.uuid.lower().startswith(entry.lower())]
        return hits[0] if len(hits) == 1 else None
    return None


def format_topology(probe: LocalProbe) -> str:
    """The GPU matrix laid out as `nvidia-smi topo -m` does, with CPU and NUMA affinity columns."""
    if not probe.gpus:
        return probe.note
    heads = [f"GPU{gpu.index}" for gpu in probe.gpus]
    rows = [["", *heads, "CPU Affinity", "NUMA Affinity"]]
    for gpu, links in zip(probe.gpus, probe.topology, strict=True):
        cpus = format_cpulist(gpu.cpu_affinity) if gpu.cpu_affinity else "N/A"
        numa = str(gpu.numa_node) if gpu.numa_node is not None else "N/A"
        rows.append([f"GPU{gpu.index}", *links, cpus, numa])
    widths = [max(len(row[col]) for row in rows) for col in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)

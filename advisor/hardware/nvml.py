"""GPUs and their interconnect topology, read through NVML (nvidia-ml-py) behind one small class.

`NvmlReader` is handed the NVML module (`pynvml`, or a stand-in exposing the same functions,
constants and `NVMLError`), so the probe never imports it at module load and a test can
substitute the module and nothing else. NVML errors propagate as `NVMLError`; the caller
decides what an unusable NVML means.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from advisor.errors import ProbeError
from advisor.hardware.sysinfo import SYS, NumaNode, local_cpulist_for_pci, normalize_pci_bus_id, pci_numa_node

_AFFINITY_WORD_BITS = 64  # nvmlDeviceGetCpuAffinity fills an array of 64-bit CPU masks


class GpuInfo(BaseModel):
    """One NVIDIA GPU as NVML and sysfs describe it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int = Field(ge=0, description="NVML index (PCI bus order, as nvidia-smi numbers GPUs).")
    name: str = Field(description="NVML product name, e.g. 'NVIDIA H100 80GB HBM3'.")
    uuid: str = Field(description="'GPU-…' UUID, as CUDA_VISIBLE_DEVICES may name it.")
    memory_bytes: int = Field(gt=0, description="Total device memory NVML reports (bytes).")
    driver_version: str = Field(description="NVIDIA driver version (the same for every GPU of a host).")
    pci_bus_id: str = Field(description="PCI address in sysfs form, e.g. '0000:07:00.0'.")
    cpu_affinity: list[int] | None = Field(description="Logical CPUs local to this GPU; None if unknown.")
    numa_node: int | None = Field(description="NUMA node the GPU hangs off; None if unknown.")


class NvmlSnapshot(BaseModel):
    """What one NVML session saw: the GPUs and the `nvidia-smi topo -m` style GPU x GPU matrix."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    driver_version: str
    gpus: list[GpuInfo]
    topology: list[list[str]] = Field(
        description="topology[i][j]: 'X' (self), 'NV<n>' (n NVLinks), else the closest common PCIe "
        "ancestor: 'PIX', 'PXB', 'PHB', 'NODE', 'SYS'; 'N/A' where NVML cannot tell."
    )


@dataclass
class _Links:
    """One GPU's active NVLinks: counted per peer GPU (by PCI bus id), and to NVSwitches."""

    to_gpu: Counter[str] = field(default_factory=Counter)
    to_switch: int = 0


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py returns bytes from string getters and struct fields.
    return value.decode() if isinstance(value, bytes) else value


class NvmlReader:
    """Reads GPUs and topology from an NVML module.

    `numa` is the host's NUMA layout, used to place a GPU whose sysfs `numa_node` is missing
    (the node holding all of its affine CPUs); `sys_root` is where sysfs is mounted.
    """

    def __init__(self, nvml: Any, numa: list[NumaNode] | None = None, sys_root: Path = SYS) -> None:
        self._nv = nvml
        self._numa = numa or []
        self._sys = sys_root

    def read(self) -> NvmlSnapshot:
        nv = self._nv
        nv.nvmlInit()
        try:
            driver = _text(nv.nvmlSystemGetDriverVersion())
            handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
            gpus = [self._gpu(i, handle, driver) for i, handle in enumerate(handles)]
            topology = self._topology(handles, [gpu.pci_bus_id for gpu in gpus])
        finally:
            nv.nvmlShutdown()
        return NvmlSnapshot(driver_version=driver, gpus=gpus, topology=topology)

    def _error_in(self, err: Exception, *names: str) -> bool:
        return getattr(err, "value", None) in {getattr(self._nv, name) for name in names}

    def _gpu(self, index: int, handle: Any, driver: str) -> GpuInfo:
        nv = self._nv
        bus_id = normalize_pci_bus_id(_text(nv.nvmlDeviceGetPciInfo(handle).busId))
        affinity = self._cpu_affinity(handle, bus_id)
        return GpuInfo(
            index=index,
            name=_text(nv.nvmlDeviceGetName(handle)),
            uuid=_text(nv.nvmlDeviceGetUUID(handle)),
            memory_bytes=int(nv.nvmlDeviceGetMemoryInfo(handle).total),
            driver_version=driver,
            pci_bus_id=bus_id,
            cpu_affinity=affinity,
            numa_node=self._numa_node(bus_id, affinity),
        )

    def _cpu_affinity(self, handle: Any, bus_id: str) -> list[int] | None:
        words = math.ceil((os.cpu_count() or 1) / _AFFINITY_WORD_BITS)
        try:
            masks = self._nv.nvmlDeviceGetCpuAffinity(handle, words)
        except self._nv.NVMLError as err:
            if not self._error_in(err, "NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND"):
                raise
            # Not every platform (e.g. some VMs) reports affinity through NVML; sysfs may.
            try:
                return local_cpulist_for_pci(bus_id, self._sys)
            except ProbeError:
                return None
        cpus = [
            word_index * _AFFINITY_WORD_BITS + bit
            for word_index, mask in enumerate(masks)
            for bit in range(_AFFINITY_WORD_BITS)
            if (int(mask) >> bit) & 1
        ]
        return cpus or None

    def _numa_node(self, bus_id: str, affinity: list[int] | None) -> int | None:
        node = pci_numa_node(bus_id, self._sys)
        if node is not None or not affinity:
            return node
        holding = [n.id for n in self._numa if set(affinity) <= set(n.cpus)]
        return holding[0] if len(holding) == 1 else None

    def _nvlinks(self, handle: Any) -> _Links:
        nv = self._nv
        links = _Links()
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                if nv.nvmlDeviceGetNvLinkState(handle, link) != nv.NVML_FEATURE_ENABLED:
                    continue
                kind = self._remote_type(handle, link)
                if kind == nv.NVML_NVLINK_DEVICE_TYPE_SWITCH:
                    links.to_switch += 1
                elif kind in (None, nv.NVML_NVLINK_DEVICE_TYPE_GPU):
                    remote = _text(nv.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
                    links.to_gpu[normalize_pci_bus_id(remote)] += 1
                # An IBM NPU (POWER9 CPU) link carries no GPU-to-GPU traffic: not counted.
            except nv.NVMLError as err:
                # GPUs without NVLink answer NOT_SUPPORTED; link numbers past this GPU's last
                # link answer INVALID_ARGUMENT. Both mean "no such link", nothing else does.
                if not self._error_in(err, "NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_INVALID_ARGUMENT"):
                    raise
        return links

    def _remote_type(self, handle: Any, link: int) -> int | None:
        """The far end's device type; None where the driver predates the query."""
        try:
            return int(self._nv.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link))
        except self._nv.NVMLError as err:
            if not self._error_in(err, "NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_NOT_SUPPORTED"):
                raise
            return None

    def _topology(self, handles: list[Any], bus_ids: list[str]) -> list[list[str]]:
        links = [self._nvlinks(handle) for handle in handles]
        matrix = []
        for i, handle in enumerate(handles):
            row = []
            for j, other in enumerate(handles):
                if i == j:
                    row.append("X")
                    continue
                # Direct links to GPU j, plus paths through NVSwitches both GPUs attach to:
                # nvidia-smi shows every pair on an 18-link HGX H100 board as NV18.
                count = links[i].to_gpu[bus_ids[j]] + min(links[i].to_switch, links[j].to_switch)
                row.append(f"NV{count}" if count else self._pcie_label(handle, other))
            matrix.append(row)
        return matrix

    def _pcie_label(self, a: Any, b: Any) -> str:
        nv = self._nv
        labels = {
            nv.NVML_TOPOLOGY_INTERNAL: "PIX",  # two GPUs on one board (K80, M60): nearest level
            nv.NVML_TOPOLOGY_SINGLE: "PIX",  # at most one PCIe bridge between them
            nv.NVML_TOPOLOGY_MULTIPLE: "PXB",  # several PCIe bridges, no host bridge
            nv.NVML_TOPOLOGY_HOSTBRIDGE: "PHB",  # through one PCIe host bridge
            nv.NVML_TOPOLOGY_NODE: "NODE",  # host bridges within one NUMA node
            nv.NVML_TOPOLOGY_SYSTEM: "SYS",  # across the inter-socket link (QPI/UPI/xGMI)
        }
        try:
            level = int(nv.nvmlDeviceGetTopologyCommonAncestor(a, b))
        except nv.NVMLError as err:
            if not self._error_in(err, "NVML_ERROR_NOT_SUPPORTED"):
                raise
            return "N/A"
        return labels.get(level, "N/A")

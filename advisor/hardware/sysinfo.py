"""Host facts from Linux procfs/sysfs: CPU model and cores, NUMA nodes, memory, PCI locality.

Every reader takes its root path as an argument (default: the real one) and raises
`ProbeError` when a file it needs is unreadable; files that legitimately may be absent
(NUMA, cgroup limits, per-device PCI locality) return None instead.
"""

from __future__ import annotations

import functools
import os
import platform
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from advisor.errors import ProbeError
from advisor.hardware.cpupeak import bf16_unit, probe_cpu_spec, usable_core_count
from advisor.hardware.procfs import PROC, SYS, parse_cpulist
from advisor.hardware.procfs import read_optional as _read_optional
from advisor.hardware.procfs import read_text as _read
from advisor.hardware.spec import CpuSpec

# cgroup v1 writes "no limit" as the largest page-aligned int64; anything this large means none.
_CGROUP_V1_UNLIMITED = 2**60
_PCI_BUS_ID = re.compile(r"^([0-9a-fA-F]{1,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


class CpuInfo(BaseModel):
    """The host's CPUs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_name: str = Field(description="CPU model as /proc/cpuinfo names it ('unknown' where it does not).")
    logical_cores: int = Field(gt=0, description="Logical CPUs (hardware threads), os.cpu_count().")
    physical_cores: int = Field(gt=0, description="Distinct (package, core) pairs from sysfs topology.")
    usable_cores: int = Field(gt=0, description="CPUs this process may run on (sched_getaffinity).")
    bf16_units: bool = Field(default=False, description="bf16 math instructions (AMX-BF16 or AVX512-BF16 on x86, "
                             "BF16 on Arm): without them bf16 is emulated, slower than fp32.")
    spec: CpuSpec = Field(description="Identity, ISA, usable cores, clock and FLOP/cycle: the derived peak's inputs.")
    peak_tflops: dict[str, float] | None = Field(
        description="Dense peak TFLOP/s by dtype derived from `spec` (cores x GHz x FLOP/cycle); None where the "
        "clock or the ISA is unknown, and `--hardware cpu` falls back to the catalog's nominal figures.")


class NumaNode(BaseModel):
    """One NUMA node: its CPUs and its memory."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: int = Field(ge=0, description="Node number, as in /sys/devices/system/node/node<id>.")
    cpus: list[int] = Field(description="Logical CPU ids local to this node.")
    memory_bytes: int | None = Field(default=None, ge=0, description="MemTotal of the node (bytes).")


def host_memory_bytes(proc: Path = PROC) -> int:
    """MemTotal from /proc/meminfo (bytes; the file counts kB = 1024 bytes)."""
    for line in _read(proc / "meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise ProbeError(f"{proc / 'meminfo'} has no MemTotal line")


def cgroup_memory_limit_bytes(cgroup: Path = SYS / "fs" / "cgroup") -> int | None:
    """This container's memory limit (bytes) as its own cgroup view shows it; None if unlimited."""
    v2 = _read_optional(cgroup / "memory.max")
    if v2 is not None:
        return None if v2.strip() == "max" else int(v2)
    v1 = _read_optional(cgroup / "memory" / "memory.limit_in_bytes")
    if v1 is not None and int(v1) < _CGROUP_V1_UNLIMITED:
        return int(v1)
    return None


def cpu_model_name(proc: Path = PROC) -> str:
    """'model name' from /proc/cpuinfo (x86); ARM kernels omit it, so fall back to the machine."""
    for line in _read(proc / "cpuinfo").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return value.strip()
    return platform.processor() or platform.machine() or "unknown"


def cpu_flags(proc: Path = PROC) -> frozenset[str]:
    """The first CPU's feature flags from /proc/cpuinfo (x86 'flags', Arm 'Features'); empty if none."""
    for line in _read(proc / "cpuinfo").splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@functools.lru_cache(maxsize=1)
def cpu_has_bf16_units() -> bool:
    """Whether this machine's CPU has bf16 math instructions (cached: the flags do not change)."""
    return bf16_unit(cpu_flags()) is not None


def physical_core_count(sys_root: Path = SYS) -> int | None:
    """Distinct (physical_package_id, core_id) pairs over the online CPUs; None without sysfs topology."""
    online = _read_optional(sys_root / "devices" / "system" / "cpu" / "online")
    if online is None:
        return None
    cores, source = usable_core_count(parse_cpulist(online), sys_root)
    return cores if source == "topology" and cores else None


def cpu_info(proc: Path = PROC, sys_root: Path = SYS, cpus: list[int] | None = None) -> CpuInfo:
    """The host's CPUs; `cpus`: those the derived peak counts (default: sched_getaffinity's)."""
    logical = os.cpu_count()
    if logical is None:
        raise ProbeError("os.cpu_count() cannot tell how many CPUs this machine has")
    spec = probe_cpu_spec(proc, sys_root, cpus)
    return CpuInfo(
        model_name=cpu_model_name(proc),
        logical_cores=logical,
        # Without sysfs topology, assume no SMT rather than guess a ratio.
        physical_cores=physical_core_count(sys_root) or logical,
        usable_cores=len(os.sched_getaffinity(0)),
        bf16_units=spec.bf16_unit is not None,
        spec=spec,
        peak_tflops=spec.peak_tflops(),
    )


def numa_nodes(sys_root: Path = SYS) -> list[NumaNode]:
    """NUMA nodes from /sys/devices/system/node/node*/{cpulist,meminfo}; [] where the kernel has none."""
    node_dir = sys_root / "devices" / "system" / "node"
    nodes = []
    for path in node_dir.glob("node[0-9]*"):
        meminfo = _read_optional(path / "meminfo")
        nodes.append(
            NumaNode(
                id=int(path.name.removeprefix("node")),
                cpus=parse_cpulist(_read(path / "cpulist")),
                memory_bytes=_node_mem_total(meminfo) if meminfo is not None else None,
            )
        )
    return sorted(nodes, key=lambda node: node.id)


def _node_mem_total(meminfo: str) -> int | None:
    # Lines look like "Node 0 MemTotal:       32780856 kB".
    match = re.search(r"MemTotal:\s+(\d+)\s*kB", meminfo)
    return int(match.group(1)) * 1024 if match else None


def normalize_pci_bus_id(bus_id: str) -> str:
    """Map NVML's '00000000:07:00.0' (8-digit domain) to sysfs's '0000:07:00.0', lower case."""
    match = _PCI_BUS_ID.match(bus_id.strip())
    if match is None:
        raise ProbeError(f"malformed PCI bus id {bus_id!r}: expected 'domain:bus:device.function'")
    domain, bus, device, function = match.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{device.lower()}.{function}"


def local_cpulist_for_pci(bus_id: str, sys_root: Path = SYS) -> list[int]:
    """CPUs local to a PCI device, from /sys/bus/pci/devices/<id>/local_cpulist."""
    path = sys_root / "bus" / "pci" / "devices" / normalize_pci_bus_id(bus_id) / "local_cpulist"
    return parse_cpulist(_read(path))


def pci_numa_node(bus_id: str, sys_root: Path = SYS) -> int | None:
    """NUMA node of a PCI device from sysfs; None when the file is absent or says -1 (no affinity)."""
    text = _read_optional(sys_root / "bus" / "pci" / "devices" / normalize_pci_bus_id(bus_id) / "numa_node")
    if text is None or int(text) < 0:
        return None
    return int(text)


def format_cpulist(cpus: list[int]) -> str:
    """The inverse of `parse_cpulist`: [0, 1, 2, 3, 8] -> '0-3,8'."""
    ranges: list[str] = []
    ordered = sorted(set(cpus))
    start = prev = None
    for cpu in [*ordered, None]:
        if prev is not None and cpu == prev + 1:
            prev = cpu
            continue
        if start is not None:
            ranges.append(f"{start}-{prev}" if prev != start else f"{start}")
        start = prev = cpu
    return ",".join(ranges)


class HostInfo(BaseModel):
    """This host without its GPUs: CPUs, NUMA layout and memory."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu: CpuInfo
    numa_nodes: list[NumaNode] = Field(description="NUMA nodes; empty where the kernel exposes none.")
    host_memory_bytes: int = Field(gt=0, description="MemTotal from /proc/meminfo (bytes).")
    memory_limit_bytes: int | None = Field(
        default=None, gt=0, description="This container's cgroup memory limit (bytes); None if unlimited."
    )

    @property
    def usable_memory_bytes(self) -> int:
        """Host memory a process here can actually get (bytes): MemTotal, capped by the cgroup limit."""
        if self.memory_limit_bytes is None:
            return self.host_memory_bytes
        return min(self.host_memory_bytes, self.memory_limit_bytes)


def probe_host(proc: Path = PROC, sys_root: Path = SYS, cpus: list[int] | None = None) -> HostInfo:
    """Read CPUs, NUMA nodes and memory from procfs/sysfs (no GPU access); `cpus` as in `cpu_info`."""
    return HostInfo(
        cpu=cpu_info(proc, sys_root, cpus),
        numa_nodes=numa_nodes(sys_root),
        host_memory_bytes=host_memory_bytes(proc),
        memory_limit_bytes=cgroup_memory_limit_bytes(sys_root / "fs" / "cgroup"),
    )

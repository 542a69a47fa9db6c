"""Tests for advisor.hardware: spec parsing, the catalog, and the local probe.

Everything runs against the real machine (procfs/sysfs, the real pynvml) except where a test
says it substitutes a stand-in NVML module -- the only thing these tests fake.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest

from advisor.errors import ProbeError, SpecError
from advisor.hardware import CATALOG, get_hardware, hardware_from_probe, list_hardware, probe_local
from advisor.hardware.catalog import catalog_key_for_gpu
from advisor.hardware.probe import format_topology, visible_gpu_indices
from advisor.hardware.sysinfo import (
    cpu_flags,
    cpu_has_bf16_units,
    format_cpulist,
    host_memory_bytes,
    local_cpulist_for_pci,
    normalize_pci_bus_id,
    numa_nodes,
    parse_cpulist,
)

REQUIRED = [
    "a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200", "l4", "l40s", "a10g",
    "t4", "v100", "rtx-4090", "rtx-3090", "mi300x", "cpu",
]  # fmt: skip
DTYPES = {"fp32", "tf32", "bf16", "fp16"}


def _meminfo_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


# --- spec parsing -------------------------------------------------------------------------


def test_bare_name_is_one_device_on_one_node() -> None:
    spec = get_hardware("h100-sxm")
    assert spec.accelerator == CATALOG["h100-sxm"]
    assert (spec.devices_per_node, spec.nodes, spec.is_local) == (1, 1, False)


def test_count_forms_and_case() -> None:
    assert get_hardware("h100-sxm:8").world_size == 8
    two_nodes = get_hardware(" A100-80GB:8x2 ")
    assert (two_nodes.devices_per_node, two_nodes.nodes, two_nodes.world_size) == (8, 2, 16)
    assert two_nodes.accelerator.name == "a100-80gb"


def test_unknown_name_lists_every_valid_name_on_one_line() -> None:
    with pytest.raises(SpecError) as err:
        get_hardware("h100")
    message = str(err.value)
    assert message.startswith("unknown hardware 'h100'; valid: ")
    assert "\n" not in message
    assert all(name in message for name in list_hardware())


@pytest.mark.parametrize("bad", ["h100-sxm:0", "h100-sxm:-1", "h100-sxm:two", "h100-sxm:8x0", "h100-sxm:", "t4:1.5"])
def test_bad_counts_say_what_is_allowed(bad: str) -> None:
    with pytest.raises(SpecError, match="positive integers"):
        get_hardware(bad)


def test_local_takes_no_count() -> None:
    with pytest.raises(SpecError, match="'local' takes no device count"):
        get_hardware("local:2")


def test_list_hardware_is_catalog_plus_local() -> None:
    names = list_hardware()
    assert names[-1] == "local"
    assert set(names[:-1]) == set(CATALOG)
    assert all(name in names for name in REQUIRED)


def test_cpu_with_count_is_the_nominal_catalog_cpu() -> None:
    spec = get_hardware("cpu:2")
    assert spec.is_local is False
    assert spec.host_memory_bytes == CATALOG["cpu"].memory_bytes
    assert spec.device_type == "cpu"
    assert spec.cpu_cores is None


# --- catalog sanity -----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_catalog_entry_is_consistent(name: str) -> None:
    acc = CATALOG[name]
    assert acc.name == name
    assert acc.memory_bytes > 0 and acc.memory_bandwidth_gbps > 0
    assert set(acc.peak_tflops) <= DTYPES
    assert acc.peak_tflops["fp32"] > 0
    # A dtype has a peak exactly when the device supports it.
    assert ("bf16" in acc.peak_tflops) == acc.supports_bf16
    assert ("fp16" in acc.peak_tflops) == acc.supports_fp16
    assert ("tf32" in acc.peak_tflops) == acc.supports_tf32
    for dtype, peak in acc.peak_tflops.items():
        assert peak >= acc.peak_tflops["fp32"], f"{name}: {dtype} peak below fp32"
    if acc.supports_bf16 and acc.supports_fp16:
        assert acc.peak_tflops["bf16"] == acc.peak_tflops["fp16"]
    assert (acc.interconnect == "none") == (acc.interconnect_gbps == 0)


@pytest.mark.parametrize("name", [n for n in sorted(CATALOG) if CATALOG[n].supports_tf32])
def test_tensor_peaks_are_dense(name: str) -> None:
    """bf16 tensor rate is twice tf32 on every part here; a sparsity figure in one column breaks that."""
    peaks = CATALOG[name].peak_tflops
    assert peaks["bf16"] / peaks["tf32"] == pytest.approx(2.0, rel=0.05)


def test_catalog_anchors() -> None:
    # Dense H100 SXM bf16 is half the datasheet's 1,979 sparsity figure.
    assert CATALOG["h100-sxm"].peak_tflops["bf16"] == pytest.approx(989.5)
    # Vendor capacity is binary-sized, at least what CUDA reports for the device.
    assert CATALOG["h100-sxm"].memory_bytes >= 85_520_809_984
    assert not CATALOG["t4"].supports_bf16 and not CATALOG["v100"].supports_bf16
    assert CATALOG["v100"].memory_bytes == 2 * CATALOG["v100-16gb"].memory_bytes
    assert CATALOG["mi300x"].vendor == "amd"


@pytest.mark.parametrize(
    ("nvml_name", "key"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", "h100-pcie"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100 80GB PCIe", "a100-80gb"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA A10G", "a10g"),
        ("Tesla T4", "t4"),
        ("Tesla V100-SXM2-32GB", "v100"),
        ("Tesla V100-SXM2-16GB", "v100-16gb"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("NVIDIA GeForce RTX 3090", "rtx-3090"),
        ("NVIDIA GeForce GTX 1080", None),
    ],
)
def test_gpu_names_map_to_catalog(nvml_name: str, key: str | None) -> None:
    assert catalog_key_for_gpu(nvml_name) == key


# --- this machine: procfs / sysfs ----------------------------------------------------------


def test_cpu_spec_describes_this_machine() -> None:
    spec = get_hardware("cpu")
    assert spec.is_local and spec.device_type == "cpu"
    assert spec.cpu_cores == os.cpu_count()
    total = _meminfo_total()
    # Equal to MemTotal unless a cgroup limit caps it.
    assert 0 < spec.host_memory_bytes <= total
    assert spec.memory_per_device_bytes == spec.host_memory_bytes == spec.accelerator.memory_bytes


def test_bf16_units_come_from_the_cpu_flags(tmp_path: Path) -> None:
    has_units = bool(cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"})
    assert probe_local().cpu.bf16_units == cpu_has_bf16_units() == has_units  # this machine's own flags
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n\nprocessor\t: 1\n")
    assert {"avx512_bf16", "amx_tile"} <= cpu_flags(tmp_path)  # x86
    cpuinfo.write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\nCPU implementer\t: 0x41\n")
    assert "bf16" in cpu_flags(tmp_path)  # Arm
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n")
    assert not cpu_flags(tmp_path) & {"avx512_bf16", "amx_bf16", "bf16"}


def test_local_without_visible_gpus_is_this_cpu() -> None:
    probe = probe_local()
    if probe.visible_gpus:
        pytest.skip("this machine has GPUs visible to CUDA; the GPU path is covered by the gpu test")
    spec = get_hardware("local")
    assert spec.is_local and spec.accelerator.vendor == "cpu"
    assert spec.cpu_cores == os.cpu_count()
    if probe.memory_limit_bytes is None:
        assert spec.host_memory_bytes == _meminfo_total()
    assert spec.numa_nodes == (len(probe.numa_nodes) or None)


def test_probe_without_nvml_says_why() -> None:
    probe = probe_local()
    if probe.nvml_available:
        pytest.skip("NVML is available here; the absent case is covered with a stand-in module")
    assert probe.gpus == [] and probe.topology == []
    assert probe.note.startswith("NVML not available (") and probe.note.endswith("describing the CPU only")
    assert probe.host_memory_bytes == host_memory_bytes() == _meminfo_total()


def test_numa_nodes_from_sysfs_partition_the_online_cpus() -> None:
    node_dir = Path("/sys/devices/system/node")
    if not node_dir.is_dir():
        pytest.skip("this kernel exposes no NUMA nodes in sysfs")
    nodes = numa_nodes()
    assert [f"node{n.id}" for n in nodes] == sorted(p.name for p in node_dir.glob("node[0-9]*"))
    online = parse_cpulist(Path("/sys/devices/system/cpu/online").read_text())
    cpus = [cpu for node in nodes for cpu in node.cpus]
    assert sorted(cpus) == online  # every online CPU on exactly one node (memory-only nodes add none)
    assert all(n.memory_bytes is None or n.memory_bytes > 0 for n in nodes)


def test_cpulist_parse_and_format() -> None:
    assert parse_cpulist("0-3,8-11\n") == [0, 1, 2, 3, 8, 9, 10, 11]
    assert parse_cpulist("5") == [5] and parse_cpulist("\n") == []
    assert format_cpulist([8, 0, 1, 2, 3, 10]) == "0-3,8,10"
    with pytest.raises(ProbeError, match="malformed cpulist"):
        parse_cpulist("3-1")


def test_pci_bus_ids_and_local_cpulist() -> None:
    assert normalize_pci_bus_id("00000000:8A:00.0") == "0000:8a:00.0"
    with pytest.raises(ProbeError, match="malformed PCI bus id"):
        normalize_pci_bus_id("8a:00")
    devices = sorted(Path("/sys/bus/pci/devices").glob("*/local_cpulist"))
    if not devices:
        pytest.skip("no PCI devices with local_cpulist in this machine's sysfs")
    sysfs_id = devices[0].parent.name
    nvml_form = "0000" + sysfs_id.upper()  # NVML writes an 8-digit domain, upper case
    assert local_cpulist_for_pci(nvml_form) == parse_cpulist(devices[0].read_text())
    with pytest.raises(ProbeError, match="cannot read"):
        local_cpulist_for_pci("0000abcd:ff:1f.7")


# --- topology through a stand-in NVML module ----------------------------------------------


@dataclass
class FakeGpu:
    name: str
    bus_id: str
    memory: int
    affinity: list[int] | None  # 64-bit masks; None: NVML answers NOT_SUPPORTED
    links: dict[int, tuple[int, str]] = field(default_factory=dict)  # link -> (remote type, remote bus)
    link_count: int = 0  # 0: this GPU has no NVLink at all


class FakeNvml:
    """Stand-in for the `pynvml` module: its constants and real NVMLError, canned device answers."""

    NVMLError = pynvml.NVMLError

    def __init__(self, gpus: list[FakeGpu], ancestors: dict[frozenset[int], int], fail: dict[str, int] | None = None):
        for name in dir(pynvml):
            if name.startswith("NVML_") and isinstance(getattr(pynvml, name), int):
                setattr(self, name, getattr(pynvml, name))
        self.gpus, self.ancestors, self.fail = gpus, ancestors, fail or {}
        self.shutdowns = 0

    def _maybe_fail(self, call: str) -> None:
        if call in self.fail:
            raise pynvml.NVMLError(self.fail[call])

    def nvmlInit(self) -> None:
        self._maybe_fail("init")

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return self.gpus[h].name.encode()  # older nvidia-ml-py returns bytes

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-{h:08x}-aaaa-bbbb-cccc-dddddddddddd"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(total=self.gpus[h].memory)

    def nvmlDeviceGetPciInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(busId=self.gpus[h].bus_id.encode())

    def nvmlDeviceGetCpuAffinity(self, h: int, words: int) -> list[int]:
        if self.gpus[h].affinity is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self.gpus[h].affinity

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        self._maybe_fail("nvlink_state")
        gpu = self.gpus[h]
        if gpu.link_count == 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if link >= gpu.link_count:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED if link in gpu.links else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: int, link: int) -> int:
        return self.gpus[h].links[link][0]

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int) -> SimpleNamespace:
        return SimpleNamespace(busId=self.gpus[h].links[link][1].encode())

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        return self.ancestors[frozenset((a, b))]


# Bus ids in a PCI domain no real machine uses, so sysfs has nothing for them.
BUS = ["0000ABCD:07:00.0", "0000ABCD:0F:00.0", "0000ABCD:87:00.0", "0000ABCD:8F:00.0"]
A100_80 = 85_198_045_184  # bytes CUDA reports for an A100-SXM4-80GB


def _two_socket_box() -> FakeNvml:
    """GPU0-GPU1 joined by 4 NVLinks; GPU2-GPU3 behind one PCIe switch; the pairs on different sockets."""
    gpu, sw = pynvml.NVML_NVLINK_DEVICE_TYPE_GPU, pynvml.NVML_TOPOLOGY_SINGLE
    gpus = [
        FakeGpu("NVIDIA A100-SXM4-80GB", BUS[0], A100_80, [0b01], {k: (gpu, BUS[1]) for k in range(4)}, 12),
        FakeGpu("NVIDIA A100-SXM4-80GB", BUS[1], A100_80, [0b01], {k: (gpu, BUS[0]) for k in range(4)}, 12),
        FakeGpu("NVIDIA A100-SXM4-80GB", BUS[2], A100_80, None),
        FakeGpu("NVIDIA A100-SXM4-80GB", BUS[3], A100_80 - 2**20, [0, 1 << 3]),  # CPU 67 (second mask word)
    ]
    system = pynvml.NVML_TOPOLOGY_SYSTEM
    ancestors = {frozenset((a, b)): system for a in range(4) for b in range(4) if a != b}
    ancestors[frozenset((0, 1))] = pynvml.NVML_TOPOLOGY_NODE
    ancestors[frozenset((2, 3))] = sw
    return FakeNvml(gpus, ancestors)


def test_topology_matrix_from_stand_in_nvml() -> None:
    """Substitutes a stand-in NVML module (the only faked component) to check topology parsing."""
    fake = _two_socket_box()
    probe = probe_local(nvml=fake)
    assert probe.nvml_available and fake.shutdowns == 1
    assert probe.topology == [
        ["X", "NV4", "SYS", "SYS"],
        ["NV4", "X", "SYS", "SYS"],
        ["SYS", "SYS", "X", "PIX"],
        ["SYS", "SYS", "PIX", "X"],
    ]
    gpu0, _, gpu2, gpu3 = probe.gpus
    assert gpu0.name == "NVIDIA A100-SXM4-80GB" and gpu0.pci_bus_id == "abcd:07:00.0"
    assert gpu0.driver_version == "550.54.15" and gpu0.cpu_affinity == [0]
    assert gpu2.cpu_affinity is None and gpu2.numa_node is None  # neither NVML nor sysfs knows
    assert gpu3.cpu_affinity == [67]
    # No sysfs numa_node for these ids: the node is the one holding all affine CPUs.
    holding = [n.id for n in probe.numa_nodes if 0 in n.cpus]
    assert gpu0.numa_node == (holding[0] if len(holding) == 1 else None)
    table = format_topology(probe).splitlines()
    assert table[0].split() == ["GPU0", "GPU1", "GPU2", "GPU3", "CPU", "Affinity", "NUMA", "Affinity"]
    assert table[1].split()[:5] == ["GPU0", "X", "NV4", "SYS", "SYS"]


def test_nvswitch_links_count_for_every_pair() -> None:
    """Substitutes a stand-in NVML module: 8 GPUs, each with 18 links to NVSwitches, read as NV18."""
    switch = pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
    gpus = [
        FakeGpu("NVIDIA H100 80GB HBM3", f"0000ABCD:{i:02X}:00.0", 85_520_809_984, [1],
                {k: (switch, "0000ABCD:F0:00.0") for k in range(18)}, 18)
        for i in range(8)
    ]  # fmt: skip
    probe = probe_local(nvml=FakeNvml(gpus, {}))
    assert all(probe.topology[i][j] == ("X" if i == j else "NV18") for i in range(8) for j in range(8))


def test_local_spec_from_probed_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Substitutes a stand-in NVML module; CUDA_VISIBLE_DEVICES is set for real."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    spec = hardware_from_probe(probe_local(nvml=_two_socket_box()))
    assert spec.is_local and spec.accelerator.name == "a100-80gb"
    assert spec.devices_per_node == 4 and spec.nodes == 1
    assert spec.accelerator.memory_bytes == A100_80 - 2**20  # the smallest GPU binds
    assert spec.accelerator.peak_tflops == CATALOG["a100-80gb"].peak_tflops
    assert spec.cpu_cores == os.cpu_count()

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    spec = hardware_from_probe(probe_local(nvml=_two_socket_box()))
    assert spec.devices_per_node == 2 and spec.accelerator.memory_bytes == A100_80

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert hardware_from_probe(probe_local(nvml=_two_socket_box())).accelerator.vendor == "cpu"


def test_local_spec_refuses_unknown_and_mixed_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Substitutes a stand-in NVML module with GPUs the catalog cannot describe as one type."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = _two_socket_box()
    fake.gpus[3].name = "NVIDIA GeForce GTX 1080"
    with pytest.raises(ProbeError, match="GTX 1080 has no catalog entry"):
        hardware_from_probe(probe_local(nvml=fake))
    fake.gpus[3].name = "NVIDIA L4"
    with pytest.raises(ProbeError, match="local GPUs differ"):
        hardware_from_probe(probe_local(nvml=fake))


@pytest.mark.parametrize(
    ("fail", "reason"),
    [
        ({"init": pynvml.NVML_ERROR_LIBRARY_NOT_FOUND}, "libnvidia-ml.so not found"),
        ({"init": pynvml.NVML_ERROR_DRIVER_NOT_LOADED}, "NVML error: Driver Not Loaded"),
        ({"nvlink_state": pynvml.NVML_ERROR_GPU_IS_LOST}, "NVML error: GPU is lost"),
    ],
)
def test_nvml_errors_fall_back_to_cpu_with_a_note(fail: dict[str, int], reason: str) -> None:
    """Substitutes a stand-in NVML module that raises the real pynvml.NVMLError."""
    fake = _two_socket_box()
    fake.fail = fail
    probe = probe_local(nvml=fake)
    assert not probe.nvml_available and probe.gpus == []
    assert probe.note == f"NVML not available ({reason}): describing the CPU only"
    assert hardware_from_probe(probe).accelerator.vendor == "cpu"


def test_cuda_visible_devices_rules() -> None:
    """Substitutes a stand-in NVML module only to obtain GPU records with UUIDs."""
    gpus = probe_local(nvml=_two_socket_box()).gpus
    assert visible_gpu_indices(None, gpus) == [0, 1, 2, 3]
    assert visible_gpu_indices("2,0", gpus) == [2, 0]
    assert visible_gpu_indices("0,7,1", gpus) == [0]  # an invalid entry hides the rest
    assert visible_gpu_indices("0,0", gpus) == [0]
    assert visible_gpu_indices("-1", gpus) == [] and visible_gpu_indices("", gpus) == []
    assert visible_gpu_indices("GPU-00000003,GPU-00000001-aaaa", gpus) == [3, 1]
    assert visible_gpu_indices("GPU-0000000", gpus) == []  # ambiguous prefix


# --- real NVML ------------------------------------------------------------------------------


@pytest.mark.gpu
def test_real_nvml_probe() -> None:
    probe = probe_local()
    if not probe.nvml_available or not probe.gpus:
        pytest.skip(f"no NVIDIA GPU to probe here: {probe.note}")
    n = len(probe.gpus)
    assert [len(row) for row in probe.topology] == [n] * n
    assert all(probe.topology[i][i] == "X" for i in range(n))
    for gpu in probe.gpus:
        assert gpu.memory_bytes > 2**30 and gpu.uuid.startswith("GPU-")
        assert Path("/sys/bus/pci/devices", gpu.pci_bus_id).exists()
    if probe.visible_gpus and catalog_key_for_gpu(probe.gpus[probe.visible_gpus[0]].name):
        spec = get_hardware("local")
        assert spec.is_local and spec.devices_per_node == len(probe.visible_gpus)

"""HardwareSpec: what the estimator and the tuner know about the target machine(s)."""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field


class CpuSpec(BaseModel):
    """A probed CPU: what it is, and the figures its peak is derived from.

    Peak FLOP/s per dtype = cores x clock x FLOP per cycle per core (advisor.hardware.cpupeak, where
    each per-cycle figure names its source). Only structured facts live here: they key stored results
    (hardware_fingerprint), so two CPU models never share measurements.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_name: str = Field(
        description="CPU model as /proc/cpuinfo names it (on Arm, built from implementer and part).")
    vendor: str = Field(
        description="x86 vendor_id ('GenuineIntel', 'AuthenticAMD'), 'arm:<implementer>', or 'unknown'.")
    family: int | None = Field(default=None, description="x86 'cpu family'; None on Arm.")
    model: int | None = Field(default=None, description="x86 'model', or the Arm 'CPU part' number.")
    microarchitecture: str = Field(description="Core family the per-cycle figures are taken for, e.g. 'zen4'; "
                                   "'unknown' where the table has none (then an assumed figure is used).")
    vector_isa: Literal["avx512", "avx2-fma", "avx", "sse", "sve", "neon", "unknown"] = Field(
        description="Widest vector multiply-add path the /proc/cpuinfo flags report.")
    bf16_unit: Literal["amx", "avx512_bf16", "arm_bf16"] | None = Field(
        description="bf16 math instructions (AMX-BF16, AVX512-BF16, Arm BF16); None: bf16 is emulated via fp32.")
    cores: int = Field(gt=0, description="Physical cores among the CPUs this process may use (SMT siblings share "
                       "one core's FMA units, so they count once); every usable CPU where sysfs has no topology.")
    cores_from: Literal["topology", "affinity"] = Field(
        description="'topology': sysfs core ids; 'affinity': no topology, each usable CPU counted as a core.")
    clock_ghz: float | None = Field(default=None, gt=0, description="Clock the peak assumes (GHz); None: unknown.")
    clock_source: Literal["cpufreq", "cpuinfo", "none"] = Field(
        description="'cpufreq': sysfs cpuinfo_max_freq (the top boost clock); 'cpuinfo': /proc/cpuinfo 'cpu MHz' "
        "(in VMs, usually the nominal clock); 'none': neither.")
    fp32_flop_per_cycle: int | None = Field(default=None, gt=0, description="Dense fp32 FLOP per cycle per core.")
    bf16_flop_per_cycle: int | None = Field(default=None, gt=0, description="Dense bf16 FLOP per cycle per core "
                                            "(= fp32's where bf16 is emulated).")
    per_cycle_from: Literal["documented", "assumed"] = Field(
        description="'documented': the microarchitecture's FMA units from its vendor's optimization guide; "
        "'assumed': the least any core with these flags has.")

    def peak_tflops(self) -> dict[str, float] | None:
        """Dense peak TFLOP/s by dtype (fp32, bf16), or None when the clock or the per-cycle figures are unknown."""
        if self.clock_ghz is None or self.fp32_flop_per_cycle is None or self.bf16_flop_per_cycle is None:
            return None
        per_cycle = {"fp32": self.fp32_flop_per_cycle, "bf16": self.bf16_flop_per_cycle}
        # cores x GHz (1e9 cycles/s) x FLOP/cycle, in TFLOP/s (1e12 FLOP/s).
        return {dtype: self.cores * self.clock_ghz * flop / 1e3 for dtype, flop in per_cycle.items()}


class Accelerator(BaseModel):
    """One catalog device type. Throughputs are vendor peaks for dense math (no sparsity)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Catalog key, e.g. 'h100-sxm'.")
    vendor: str = Field(description="'nvidia', 'amd' or 'cpu'.")
    memory_bytes: int = Field(gt=0, description="Device memory per device (bytes).")
    peak_tflops: dict[str, float] = Field(description="Dense peak TFLOP/s by dtype: fp32, tf32, bf16, fp16.")
    memory_bandwidth_gbps: float = Field(gt=0, description="Device memory bandwidth (GB/s). A CPU's is the catalog's "
                                         "nominal figure, probed or not: no host file states it.")
    interconnect: str = Field(description="e.g. 'nvlink4', 'pcie4', 'none'.")
    interconnect_gbps: float = Field(ge=0, description="Per-device bidirectional interconnect bandwidth (GB/s).")
    supports_bf16: bool = True
    supports_fp16: bool = True
    supports_tf32: bool = False
    multiprocessors: int | None = Field(default=None, gt=0, description="Streaming multiprocessors (NVIDIA) or compute "
                                        "units (AMD): how torch's kernels size their launch grids and scratch.")
    max_threads_per_multiprocessor: int | None = Field(default=None, gt=0, description="Resident threads per "
                                                       "multiprocessor, by compute capability.")
    cpu: CpuSpec | None = Field(default=None, description="A probed CPU's identity and the figures its peak_tflops "
                                "come from; None for catalog entries.")
    # Communication figures for alpha-beta pricing (time = latency + bytes / bandwidth). The defaults
    # describe a plain PCIe Gen4 server on 10 GbE; every catalog entry sets its own (advisor/hardware/catalog.py).
    intra_node_gbps: float = Field(default=32.0, gt=0, description="Per-device unidirectional bandwidth to the "
                                   "other devices of its node (GB/s, 1e9 B/s): half the bidirectional NVLink/xGMI "
                                   "figure, or the PCIe generation's x16 figure one way.")
    intra_node_latency_us: float = Field(default=5.7, gt=0, description="Latency of one collective step between "
                                         "devices of a node (microseconds); NCCL's ring/Simple hwLat for the link.")
    inter_node_gbps: float = Field(default=1.25, gt=0, description="Per-device unidirectional network bandwidth of "
                                   "the reference node (GB/s): the node's scale-out NICs divided by its devices.")
    inter_node_latency_us: float = Field(default=14.0, gt=0, description="Latency of one collective step between "
                                         "nodes (microseconds); NCCL's ring/Simple network hwLat.")
    devices_per_node: int = Field(default=1, gt=0, description="Devices in the reference node the inter-node figure "
                                  "describes (a DGX: 8). Not the target's count: HardwareSpec.devices_per_node is.")


class Link(NamedTuple):
    """The link that bounds one process group: its bandwidth, per-step latency, and whether it crosses nodes."""

    gbps: float  # per-device unidirectional GB/s
    latency_us: float  # per collective step, microseconds
    crosses_nodes: bool


class HardwareSpec(BaseModel):
    """A target: `devices_per_node` x `nodes` devices of one accelerator type, and the hosts around them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    accelerator: Accelerator
    devices_per_node: int = Field(default=1, gt=0)
    nodes: int = Field(default=1, gt=0)
    host_memory_bytes: int | None = Field(default=None, gt=0, description="Host RAM per node (bytes).")
    cpu_cores: int | None = Field(default=None, gt=0, description="Physical or logical CPU cores per node.")
    numa_nodes: int | None = Field(default=None, gt=0)
    is_local: bool = Field(default=False, description="Describes this machine (probed), so calibration may run here.")
    note: str | None = Field(default=None, description="One line from the probe, e.g. why no GPU was described.")

    @property
    def device_type(self) -> str:
        """'cuda' for NVIDIA/AMD (ROCm also reports as cuda in torch), 'cpu' otherwise."""
        return "cpu" if self.accelerator.vendor == "cpu" else "cuda"

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def memory_per_device_bytes(self) -> int:
        if self.device_type == "cpu" and self.host_memory_bytes:
            return self.host_memory_bytes
        return self.accelerator.memory_bytes

    def link_for(self, group_size: int, stride: int = 1) -> Link:
        """The link bounding a process group of `group_size` ranks whose consecutive members are `stride` apart.

        Global ranks fill a node first: rank r sits on node r // devices_per_node. Groups tile the ranks as a
        device mesh does: blocks of group_size x stride consecutive ranks, each holding `stride` groups
        {b + j + i*stride : i < group_size}. The groups run their collectives together, so the slowest one
        binds: the group crosses nodes when any group of the tiling spans two nodes, which is when nodes > 1,
        group_size > 1 and the block does not divide devices_per_node. Crossing: the accelerator's inter-node
        bandwidth and latency (each device has its own share of the node's NICs); otherwise the intra-node
        ones. A group of one communicates with no one: intra-node figures, not crossing.
        Raises ValueError when group_size or stride is below 1, or the block does not divide world_size.
        """
        if group_size < 1 or stride < 1:
            raise ValueError(f"group_size and stride must be >= 1 (got {group_size}, {stride})")
        block = group_size * stride
        if self.world_size % block:
            raise ValueError(f"a group of {group_size} with stride {stride} spans {block} ranks, which does not "
                             f"divide the {self.world_size} ranks of {self.devices_per_node} x {self.nodes}")
        acc = self.accelerator
        crosses = self.nodes > 1 and group_size > 1 and self.devices_per_node % block != 0
        if crosses:
            return Link(acc.inter_node_gbps, acc.inter_node_latency_us, True)
        return Link(acc.intra_node_gbps, acc.intra_node_latency_us, False)

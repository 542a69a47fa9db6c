"""HardwareSpec: what the estimator and the tuner know about the target machine(s)."""

from __future__ import annotations

from typing import Literal

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

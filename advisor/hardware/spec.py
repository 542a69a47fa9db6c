"""HardwareSpec: what the estimator and the tuner know about the target machine(s)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Accelerator(BaseModel):
    """One catalog device type. Throughputs are vendor peaks for dense math (no sparsity)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Catalog key, e.g. 'h100-sxm'.")
    vendor: str = Field(description="'nvidia', 'amd' or 'cpu'.")
    memory_bytes: int = Field(gt=0, description="Device memory per device (bytes).")
    peak_tflops: dict[str, float] = Field(description="Dense peak TFLOP/s by dtype: fp32, tf32, bf16, fp16.")
    memory_bandwidth_gbps: float = Field(gt=0, description="Device memory bandwidth (GB/s).")
    interconnect: str = Field(description="e.g. 'nvlink4', 'pcie4', 'none'.")
    interconnect_gbps: float = Field(ge=0, description="Per-device bidirectional interconnect bandwidth (GB/s).")
    supports_bf16: bool = True
    supports_fp16: bool = True
    supports_tf32: bool = False


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

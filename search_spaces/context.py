"""SpaceContext: the target a space is evaluated against (hardware, workload facts, global batch)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from advisor.hardware.spec import HardwareSpec
from advisor.workload import DecoderArch

if TYPE_CHECKING:
    from advisor.workload import Workload, WorkloadInfo


class SpaceContext(BaseModel):
    """What conditions test: the hardware, whether the model is a conv net, the devices a trial may
    use, the workload's own batch size, and the effective batch to hold fixed (if any); and the
    decoder shape the tp and pp values must fit (search_spaces/layout.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hardware: HardwareSpec
    conv_net: bool = Field(default=False, description="A convolutional net: channels_last applies.")
    device_count: int = Field(ge=1, description="Devices (processes) a multi-process trial uses.")
    default_batch_size: int = Field(gt=0, description="The workload's own batch size (samples).")
    global_batch_size: int | None = Field(
        default=None, gt=0,
        description="Samples per optimizer step over all processes; grad_accum is derived to keep it (samples).")
    fast_bf16: bool | None = Field(
        default=None, description="bf16 runs faster than fp32 here: bf16 math units (CUDA tensor cores; AMX or "
        "AVX512-BF16 on x86; BF16 on Arm). None: CUDA devices that support bf16, and a probed CPU by its "
        "spec's bf16 unit (this machine's flags); a catalog CPU (not probed) is taken to have none.")
    decoder: DecoderArch | None = Field(
        default=None, description="The workload's decoder shape: tp must divide its heads, kv_heads and ffn, and pp "
        "cut its layers. None: the workload is not a decoder, and tp and pp stay 1 in a search.")
    lora: bool = Field(default=False, description="The workload is fine-tuned with LoRA adapters "
                       "(advisor/finetune.py): lora_r applies.")

    @model_validator(mode="after")
    def _check(self) -> "SpaceContext":
        hw = self.hardware
        if hw.device_type == "cuda" and self.device_count > hw.devices_per_node:
            raise ValueError(f"device_count {self.device_count} exceeds the {hw.devices_per_node} device(s) per "
                             f"node of {hw.accelerator.name}")
        return self

    @classmethod
    def for_target(cls, hardware: HardwareSpec, workload: "Workload | WorkloadInfo", *,
                   global_batch_size: int | None = None, device_count: int | None = None,
                   lora: bool = False) -> "SpaceContext":
        """The context for `workload` on `hardware`: every device of one node unless told otherwise; `lora`:
        the workload's arguments carry a LoRA fine-tune."""
        return cls(hardware=hardware, conv_net=workload.conv_net,
                   device_count=device_count or hardware.devices_per_node,
                   default_batch_size=workload.default_batch_size, global_batch_size=global_batch_size,
                   decoder=workload.decoder, lora=lora)

    @property
    def device(self) -> str:
        return self.hardware.device_type

    def facts(self) -> dict[str, Any]:
        """The names a condition's `when` may test about the target (spec.FACTS)."""
        acc = self.hardware.accelerator
        return {
            "device": self.device, "device_count": self.device_count, "supports_bf16": acc.supports_bf16,
            "fast_bf16": self.fast_bf16 if self.fast_bf16 is not None else _fast_bf16(self.hardware),
            "supports_fp16": acc.supports_fp16, "supports_tf32": acc.supports_tf32, "conv_net": self.conv_net,
            "cpu_cores": self.hardware.cpu_cores, "numa_nodes": self.hardware.numa_nodes,
            "default_batch_size": self.default_batch_size, "global_batch_size": self.global_batch_size,
            "lora": self.lora,
        }


def _fast_bf16(hw: HardwareSpec) -> bool:
    if not hw.accelerator.supports_bf16:
        return False
    if hw.device_type == "cuda":
        return True  # every catalog GPU that supports bf16 has tensor cores for it
    if hw.accelerator.cpu is not None:  # a probed CPU, here or stored from another host
        return hw.accelerator.cpu.bf16_unit is not None
    from advisor.hardware.sysinfo import cpu_has_bf16_units

    return hw.is_local and cpu_has_bf16_units()

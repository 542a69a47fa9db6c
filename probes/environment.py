"""The environment fingerprint a measurement is only valid for: software, device and CPU."""

from __future__ import annotations

import os
import platform

from advisor.trial import Environment


def _cuda_driver() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return str(pynvml.nvmlSystemGetDriverVersion())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - NVML absent or unusable: the driver is simply unknown
        return None


def environment(device: str) -> Environment:
    """Describe where `device` ('cpu' or 'cuda:N') runs, from torch, NVML and /proc."""
    import torch

    from advisor.hardware.sysinfo import cpu_model_name

    cpu = cpu_model_name()
    on_cuda = device.startswith("cuda")
    return Environment(
        torch=torch.__version__,
        python=platform.python_version(),
        platform=f"{platform.system()} {platform.release()} {platform.machine()}",
        cpu_model=cpu,
        cpu_count=len(os.sched_getaffinity(0)),
        intra_op_threads=torch.get_num_threads(),
        cuda=torch.version.cuda if on_cuda else None,
        driver=_cuda_driver() if on_cuda else None,
        device_name=torch.cuda.get_device_name(torch.device(device)) if on_cuda else cpu,
        niceness=os.getpriority(os.PRIO_PROCESS, 0),
    )

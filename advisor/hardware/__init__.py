"""Hardware targets: the catalog, the local probe, and `get_hardware(spec)` that turns a name into a HardwareSpec.

Spec strings:

- `NAME`: one device of catalog entry NAME (e.g. `h100-sxm`), one node.
- `NAME:N`: N devices per node; `NAME:NxM`: N devices per node on M nodes.
- `local`: this machine, probed. With NVIDIA GPUs visible to CUDA: their catalog entry (matched
  by product name) with the probed memory, one device per visible GPU. Without: the `cpu`
  entry carrying this machine's host memory, cores and NUMA nodes.
- `cpu`: this machine's CPU, like `local` on a GPU-less machine (host facts probed, `is_local`
  True), without touching NVML. `cpu:N[xM]` is the generic catalog CPU instead: nominal host
  memory from the catalog, nothing probed, `is_local` False.
"""

from __future__ import annotations

import re

from advisor.errors import ProbeError, SpecError
from advisor.hardware.catalog import CATALOG, catalog_key_for_gpu
from advisor.hardware.probe import LocalProbe, probe_local
from advisor.hardware.spec import Accelerator, HardwareSpec
from advisor.hardware.sysinfo import HostInfo, probe_host

__all__ = [
    "CATALOG",
    "Accelerator",
    "HardwareSpec",
    "LocalProbe",
    "get_hardware",
    "hardware_from_probe",
    "list_hardware",
    "probe_local",
]

LOCAL = "local"
_COUNT = re.compile(r"^(\d+)(?:x(\d+))?$")


def list_hardware() -> list[str]:
    """Every name `get_hardware` accepts: the catalog keys, sorted, then 'local'."""
    return [*sorted(CATALOG), LOCAL]


def get_hardware(spec: str) -> HardwareSpec:
    """Parse a hardware spec string (see the module docstring); raises SpecError on bad input."""
    name, sep, count = spec.strip().lower().partition(":")
    if name != LOCAL and name not in CATALOG:
        raise SpecError(f"unknown hardware {name!r}; valid: {', '.join(list_hardware())}")
    if name == LOCAL:
        if sep:
            raise SpecError(f"'local' takes no device count (got {spec!r}): it uses every GPU CUDA can see here")
        return hardware_from_probe(probe_local())
    if name == "cpu" and not sep:
        return _local_cpu(probe_host())
    per_node, nodes = _parse_count(count, spec) if sep else (1, 1)
    accelerator = CATALOG[name]
    # A CPU "device" holds its data in host memory; the catalog's nominal figure stands for it.
    host_memory = accelerator.memory_bytes if accelerator.vendor == "cpu" else None
    return HardwareSpec(
        accelerator=accelerator, devices_per_node=per_node, nodes=nodes, host_memory_bytes=host_memory
    )


def _parse_count(count: str, spec: str) -> tuple[int, int]:
    match = _COUNT.match(count)
    if match is None or int(match.group(1)) < 1 or int(match.group(2) or 1) < 1:
        raise SpecError(
            f"bad device count {count!r} in {spec!r}: use NAME:N (N devices per node) or NAME:NxM "
            "(N per node on M nodes), N and M positive integers"
        )
    return int(match.group(1)), int(match.group(2) or 1)


def hardware_from_probe(probe: LocalProbe) -> HardwareSpec:
    """The HardwareSpec for a probed machine: its visible GPUs if any, else its CPU."""
    if not probe.visible_gpus:
        return _local_cpu(probe).model_copy(update={"note": probe.note})
    gpus = [gpu for gpu in probe.gpus if gpu.index in probe.visible_gpus]
    keys = {gpu.name: catalog_key_for_gpu(gpu.name) for gpu in gpus}
    unknown = sorted(name for name, key in keys.items() if key is None)
    if unknown:
        raise ProbeError(
            f"local GPU {', '.join(unknown)} has no catalog entry; name the closest of "
            f"{', '.join(sorted(CATALOG))} explicitly (e.g. 'h100-sxm:{len(gpus)}')"
        )
    if len(set(keys.values())) > 1:
        raise ProbeError(
            f"local GPUs differ ({', '.join(sorted(keys))}); set CUDA_VISIBLE_DEVICES to GPUs of one type"
        )
    (key,) = set(keys.values())
    # The smallest probed memory binds: every rank must fit on its own device.
    accelerator = CATALOG[key].model_copy(update={"memory_bytes": min(gpu.memory_bytes for gpu in gpus)})
    return _local_spec(accelerator, probe, devices=len(gpus))


def _local_cpu(host: HostInfo) -> HardwareSpec:
    memory = host.usable_memory_bytes
    return _local_spec(CATALOG["cpu"].model_copy(update={"memory_bytes": memory}), host, devices=1)


def _local_spec(accelerator: Accelerator, host: HostInfo, devices: int) -> HardwareSpec:
    return HardwareSpec(
        accelerator=accelerator,
        devices_per_node=devices,
        nodes=1,
        host_memory_bytes=host.usable_memory_bytes,
        cpu_cores=host.cpu.logical_cores,
        numa_nodes=len(host.numa_nodes) or None,
        is_local=True,
    )

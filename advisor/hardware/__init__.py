"""Hardware targets: the catalog, the local probe, and `get_hardware(spec)` that turns a name into a HardwareSpec.

Spec strings:

- `NAME`: one device of catalog entry NAME (e.g. `h100-sxm`), one node.
- `NAME:N`: N devices per node; `NAME:NxM`: N devices per node on M nodes. Global ranks fill a
  node first; `HardwareSpec.link_for(group_size, stride)` says which link bounds a process group.
- `local`: this machine, probed. With NVIDIA GPUs visible to CUDA: their catalog entry (matched
  by product name) with the probed memory, one device per visible GPU. Without: this machine's
  CPU (see `cpu`).
- `cpu`: this machine's CPU, like `local` on a GPU-less machine, without touching NVML: host
  memory, cores and NUMA nodes probed, peak FLOP/s per dtype derived from its cores, clock and
  ISA (advisor.hardware.cpupeak), its model and ISA in `accelerator.cpu` (so it fingerprints
  apart from other CPUs), `is_local` True. Memory bandwidth stays the catalog's nominal figure.
  `cpu:N[xM]` is the generic catalog CPU instead: nominal figures, nothing probed, `is_local` False.
"""

from __future__ import annotations

import re

from advisor.errors import ProbeError, SpecError
from advisor.hardware.catalog import CATALOG, catalog_key_for_gpu
from advisor.hardware.cpupeak import cpu_peak_note
from advisor.hardware.probe import LocalProbe, probe_local
from advisor.hardware.spec import Accelerator, HardwareSpec, Link
from advisor.hardware.sysinfo import HostInfo, probe_host

__all__ = [
    "CATALOG",
    "Accelerator",
    "HardwareSpec",
    "Link",
    "LocalProbe",
    "check_hardware",
    "get_hardware",
    "hardware_from_host",
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
    name, counted, (per_node, nodes) = _parse(spec)
    if name == LOCAL:
        return hardware_from_probe(probe_local())
    if name == "cpu" and not counted:
        return hardware_from_host(probe_host())
    accelerator = CATALOG[name]
    # A CPU "device" holds its data in host memory; the catalog's nominal figure stands for it.
    host_memory = accelerator.memory_bytes if accelerator.vendor == "cpu" else None
    return HardwareSpec(
        accelerator=accelerator, devices_per_node=per_node, nodes=nodes, host_memory_bytes=host_memory
    )


def check_hardware(spec: str) -> None:
    """The SpecError `get_hardware(spec)` would raise, if any, without probing this machine: a command checks its
    hardware before it loads a workload (seconds)."""
    _parse(spec)


def _parse(spec: str) -> tuple[str, bool, tuple[int, int]]:
    """(catalog name or 'local', whether a device count was given, (devices per node, nodes)); SpecError on bad
    input."""
    name, sep, count = spec.strip().lower().partition(":")
    if name != LOCAL and name not in CATALOG:
        raise SpecError(f"unknown hardware {name!r}; valid: {', '.join(list_hardware())}")
    if name == LOCAL and sep:
        raise SpecError(f"'local' takes no device count (got {spec!r}): it uses every GPU CUDA can see here")
    return name, bool(sep), _parse_count(count, spec) if sep else (1, 1)


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
        cpu = hardware_from_host(probe)
        return cpu.model_copy(update={"note": "; ".join(n for n in (probe.note, cpu.note) if n)})
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


def hardware_from_host(host: HostInfo) -> HardwareSpec:
    """This host's CPU as the device: the catalog CPU with the host's memory, its CpuSpec, and the peaks
    derived from that where they can be (else the catalog's, and the note says why)."""
    cpu = host.cpu.spec
    update: dict[str, object] = {"memory_bytes": host.usable_memory_bytes, "cpu": cpu}
    peaks = cpu.peak_tflops()
    if peaks is not None:
        update["peak_tflops"] = peaks
    accelerator = CATALOG["cpu"].model_copy(update=update)
    return _local_spec(accelerator, host, devices=1).model_copy(update={"note": cpu_peak_note(cpu)})


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

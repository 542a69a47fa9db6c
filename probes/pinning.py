"""NUMA/CPU pinning for measured trials: which CPUs a trial's process and its DataLoader workers use.

`plan_pinning` turns the trial's pinning knob (none, the device's local node, an explicit CPU
list) into a `PinPlan`; `apply_pinning` pins the trial process, `worker_init_fn` pins each
DataLoader worker, and `verify_pinning` says whether something (e.g. a library's process-group
init) has since changed the affinity.
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from advisor.errors import ProbeError, SpecError
from advisor.hardware.sysinfo import NumaNode, format_cpulist, local_cpulist_for_pci, parse_cpulist

__all__ = ["PinPlan", "PinMode", "PinSource", "apply_pinning", "plan_pinning", "verify_pinning", "worker_init_fn"]

PinMode = Literal["none", "node", "cpus"]
PinSource = Literal["nvml", "sysfs-pci", "numa-node", "explicit"]
_DEVICE_TYPES = ("cpu", "cuda")
_TASKS = Path("/proc/self/task")


class PinPlan(BaseModel):
    """Where a trial's process and its DataLoader workers run (logical CPU ids, sorted)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    main_cpus: tuple[int, ...] = Field(min_length=1, description="Logical CPU ids for the trial process.")
    worker_cpus: tuple[int, ...] = Field(min_length=1, description="Logical CPU ids for each DataLoader worker.")
    numa_node: int | None = Field(description="NUMA node these CPUs belong to; None if unknown or several.")
    source: PinSource = Field(
        description="Where the set came from: 'nvml' (the GPU's CPU affinity as the probe read it), "
        "'sysfs-pci' (the GPU's /sys/bus/pci/devices/<id>/local_cpulist), 'numa-node' (a NUMA node's "
        "cpulist), 'explicit' (the user's list)."
    )

    @field_validator("main_cpus", "worker_cpus")
    @classmethod
    def _sorted_cpu_ids(cls, cpus: tuple[int, ...]) -> tuple[int, ...]:
        if any(cpu < 0 for cpu in cpus) or list(cpus) != sorted(set(cpus)):
            raise ValueError(f"CPU ids must be distinct, >= 0 and sorted, got {cpus}")
        return cpus


def plan_pinning(mode: PinMode, *, device_type: str, local_rank: int = 0, cpu_list: str | None = None,
                 probe: Any = None) -> PinPlan | None:
    """The CPUs a trial on `device_type` (rank `local_rank` on this host) should run on; None for 'none'.

    'node': the device's local CPUs (CUDA: the GPU's NVML affinity, else its PCI local_cpulist,
    else its NUMA node; CPU: NUMA node number local_rank mod the number of nodes that have CPUs),
    intersected with the CPUs this process may use. 'cpus': `cpu_list` ('0-3,8'), every CPU of
    which must be usable here. `probe` is a LocalProbe (CUDA) or HostInfo (CPU); default: probed now.
    Raises SpecError for a bad mode, device, rank or list, ProbeError when sysfs cannot say.
    """
    if device_type not in _DEVICE_TYPES:
        raise SpecError(f"pinning: device type {device_type!r} is not supported; allowed: {', '.join(_DEVICE_TYPES)}")
    if local_rank < 0:
        raise SpecError(f"pinning: local_rank {local_rank} is negative; give a rank >= 0")
    if mode == "none":
        return None
    if mode == "cpus":
        return _explicit_plan(cpu_list, probe)
    if mode != "node":
        raise SpecError(f"pinning mode {mode!r} is not allowed; choose from none, node, cpus")
    if device_type == "cuda":
        cpus, node, source = _cuda_local_cpus(local_rank, probe)
    else:
        cpus, node, source = _cpu_node_cpus(local_rank, probe)
    allowed = allowed_cpus()
    usable = sorted(set(cpus) & allowed)
    if not usable:
        raise SpecError(f"pinning 'node': the device's local CPUs {format_cpulist(cpus)} ({source}) include none "
                        f"this process may use ({format_cpulist(sorted(allowed))}); use 'cpus' or 'none'")
    return PinPlan(main_cpus=tuple(usable), worker_cpus=tuple(usable), numa_node=node, source=source)


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on (os.sched_getaffinity of the calling thread)."""
    return set(os.sched_getaffinity(0))


def _explicit_plan(cpu_list: str | None, probe: Any) -> PinPlan:
    allowed = allowed_cpus()
    allowed_text = format_cpulist(sorted(allowed))
    if cpu_list is None or not cpu_list.strip():
        raise SpecError(f"pinning 'cpus' needs a CPU list such as '0-3,8'; this process may use {allowed_text}")
    try:
        cpus = parse_cpulist(cpu_list)
    except ProbeError as err:
        raise SpecError(f"pinning CPU list {cpu_list!r} is malformed (expected e.g. '0-3,8'); "
                        f"this process may use {allowed_text}") from err
    outside = sorted(set(cpus) - allowed)
    if outside:
        raise SpecError(f"pinning CPU list {cpu_list!r} names CPUs {format_cpulist(outside)} that this process "
                        f"may not use; allowed: {allowed_text}")
    nodes = _nodes(probe)
    holding = [n.id for n in nodes if set(cpus) <= set(n.cpus)]
    return PinPlan(main_cpus=tuple(cpus), worker_cpus=tuple(cpus),
                   numa_node=holding[0] if len(holding) == 1 else None, source="explicit")


def _nodes(probe: Any) -> list[NumaNode]:
    if probe is not None:
        return list(probe.numa_nodes)
    from advisor.hardware.sysinfo import numa_nodes

    return numa_nodes()


def _cpu_node_cpus(local_rank: int, probe: Any) -> tuple[list[int], int, PinSource]:
    nodes = [n for n in _nodes(probe) if n.cpus]  # memory-only nodes (CXL, HBM) run no process
    if not nodes:
        raise ProbeError("pinning 'node': this kernel exposes no NUMA node with CPUs in "
                         "/sys/devices/system/node; use 'cpus' or 'none'")
    node = nodes[local_rank % len(nodes)]
    return list(node.cpus), node.id, "numa-node"


def _cuda_local_cpus(local_rank: int, probe: Any) -> tuple[list[int], int | None, PinSource]:
    if probe is None:
        from advisor.hardware.probe import probe_local

        probe = probe_local()
    if local_rank >= len(probe.visible_gpus):
        raise SpecError(f"pinning 'node' on CUDA: local rank {local_rank} has no GPU; this process sees "
                        f"{len(probe.visible_gpus)} ({probe.note})")
    index = probe.visible_gpus[local_rank]
    gpu = next(g for g in probe.gpus if g.index == index)
    # The probe's affinity is NVML's answer; where NVML cannot tell it already fell back to
    # sysfs, so 'nvml' means "what the NVML probe reported".
    if gpu.cpu_affinity:
        return list(gpu.cpu_affinity), gpu.numa_node, "nvml"
    try:
        return local_cpulist_for_pci(gpu.pci_bus_id), gpu.numa_node, "sysfs-pci"
    except ProbeError:
        pass  # no local_cpulist for this device (some VMs): the GPU's NUMA node may still be known
    node = next((n for n in probe.numa_nodes if n.id == gpu.numa_node and n.cpus), None)
    if node is None:
        raise ProbeError(f"pinning 'node': neither NVML, sysfs nor the NUMA layout says which CPUs are local "
                         f"to GPU {gpu.index} ({gpu.pci_bus_id}); use 'cpus' or 'none'")
    return list(node.cpus), node.id, "numa-node"


def apply_pinning(plan: PinPlan, *, limit_threads: bool = False) -> None:
    """Pin every thread of the calling process to `plan.main_cpus`.

    Linux affinity is per thread: pinning only the caller would leave threads already started
    (torch's intra-op pool, loggers) where they were, so each task in /proc/self/task is pinned.
    With `limit_threads`, torch's intra-op threads become min(current, number of CPUs).
    """
    cpus = set(plan.main_cpus)
    os.sched_setaffinity(0, cpus)  # the caller first: threads it starts from now on inherit this
    for tid in _thread_ids():
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            continue  # the thread exited between the listing and now
    if limit_threads:
        import torch

        torch.set_num_threads(min(torch.get_num_threads(), len(cpus)))


def _thread_ids() -> list[int]:
    try:
        return [int(entry.name) for entry in _TASKS.iterdir()]
    except FileNotFoundError:  # no procfs: the calling thread is all we can reach
        return []


def _pin_worker(cpus: tuple[int, ...], worker_id: int) -> None:
    """DataLoader worker_init_fn body: pin this worker process (called with its worker id)."""
    os.sched_setaffinity(0, cpus)


def worker_init_fn(plan: PinPlan) -> Callable[[int], None]:
    """A picklable `DataLoader(worker_init_fn=...)` that pins each worker to `plan.worker_cpus`."""
    return functools.partial(_pin_worker, plan.worker_cpus)


def verify_pinning(plan: PinPlan) -> list[str]:
    """Mismatches between the plan and the affinity of this process's threads; [] when all match."""
    want = set(plan.main_cpus)
    me = threading.get_native_id()
    problems = []
    for tid in _thread_ids() or [me]:
        try:
            have = os.sched_getaffinity(tid)
        except ProcessLookupError:
            continue
        if have != want:
            who = "calling thread" if tid == me else f"thread {tid}"
            problems.append(f"{who} runs on CPUs {format_cpulist(sorted(have))}, the plan says "
                            f"{format_cpulist(sorted(want))} ({plan.source}); call apply_pinning again")
    return problems

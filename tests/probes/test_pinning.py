"""NUMA/CPU pinning (probes.pinning) on real processes: DataLoader workers, a pinned subprocess, sysfs."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from advisor.errors import SpecError
from advisor.hardware.nvml import GpuInfo
from advisor.hardware.probe import LocalProbe
from advisor.hardware.sysinfo import format_cpulist, numa_nodes, parse_cpulist, probe_host
from probes.pinning import PinPlan, plan_pinning, verify_pinning, worker_init_fn

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = sorted(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs at least 2 usable CPUs to pin to a strict subset")


class AffinityDataset(Dataset):
    """Each item is the CPU set of the process that produced it, as a 0/1 mask over CPU ids."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        mask = torch.zeros(os.cpu_count() or 1, dtype=torch.int64)
        mask[sorted(os.sched_getaffinity(0))] = 1
        return mask


@needs_two_cpus
def test_dataloader_workers_are_pinned_to_the_plan():
    last = str(ALLOWED[-1])
    plan = plan_pinning("cpus", device_type="cpu", cpu_list=last)
    assert plan.worker_cpus == (ALLOWED[-1],) and plan.source == "explicit"
    init = pickle.loads(pickle.dumps(worker_init_fn(plan)))  # what spawn/forkserver start methods need
    loader = DataLoader(AffinityDataset(), batch_size=2, num_workers=2, worker_init_fn=init)
    batches = list(loader)
    assert len(batches) == 4
    for batch in batches:
        for mask in batch:
            assert sorted(mask.nonzero().flatten().tolist()) == [ALLOWED[-1]]
    assert sorted(os.sched_getaffinity(0)) == ALLOWED  # the test process itself stays unpinned


@needs_two_cpus
def test_apply_pins_every_thread_of_the_process():
    # In a subprocess so this test process stays unpinned. A thread started before apply_pinning
    # must end up pinned too (Linux affinity is per thread).
    script = textwrap.dedent(f"""
        import json, os, threading
        from probes.pinning import apply_pinning, plan_pinning, verify_pinning
        started, stop = threading.Event(), threading.Event()
        info = {{}}
        def other():
            info["tid"] = threading.get_native_id()
            started.set()
            stop.wait()
        t = threading.Thread(target=other); t.start(); started.wait()
        plan = plan_pinning("cpus", device_type="cpu", cpu_list="{ALLOWED[0]}")
        before = verify_pinning(plan)
        apply_pinning(plan)
        print(json.dumps({{"main": sorted(os.sched_getaffinity(0)), "other": sorted(os.sched_getaffinity(info["tid"])),
                          "before": before, "after": verify_pinning(plan)}}))
        stop.set(); t.join()
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    import json

    out = json.loads(proc.stdout)
    assert out["main"] == [ALLOWED[0]] and out["other"] == [ALLOWED[0]]
    assert len(out["before"]) >= 2 and all("the plan says" in line for line in out["before"])
    assert out["after"] == []


def test_apply_limits_torch_threads_only_when_asked():
    script = textwrap.dedent(f"""
        import torch
        from probes.pinning import apply_pinning, plan_pinning
        torch.set_num_threads(4)
        plan = plan_pinning("cpus", device_type="cpu", cpu_list="{ALLOWED[0]}")
        apply_pinning(plan)
        first = torch.get_num_threads()
        apply_pinning(plan, limit_threads=True)
        print(first, torch.get_num_threads())
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["4", "1"]


def test_verify_reports_a_reset_affinity():
    plan = PinPlan(main_cpus=(ALLOWED[0],), worker_cpus=(ALLOWED[0],), numa_node=None, source="explicit")
    if len(ALLOWED) == 1:
        assert verify_pinning(plan) == []
    else:
        problems = verify_pinning(plan)  # this process runs on every allowed CPU, not the plan's one
        assert problems and f"the plan says {ALLOWED[0]} (explicit)" in problems[0]


@pytest.mark.parametrize("cpu_list", ["0-4096", "4096", f"{ALLOWED[0]},{max(ALLOWED) + 1}"])
def test_explicit_list_outside_the_allowed_cpus_is_a_spec_error(cpu_list):
    with pytest.raises(SpecError) as err:
        plan_pinning("cpus", device_type="cpu", cpu_list=cpu_list)
    assert f"allowed: {format_cpulist(ALLOWED)}" in str(err.value)
    assert "may not use" in str(err.value)


@pytest.mark.parametrize("cpu_list", ["3-1", "a,b", "", None, "-1"])
def test_malformed_explicit_list_is_a_spec_error(cpu_list):
    with pytest.raises(SpecError) as err:
        plan_pinning("cpus", device_type="cpu", cpu_list=cpu_list)
    assert format_cpulist(ALLOWED) in str(err.value) and "0-3,8" in str(err.value)


def test_node_on_this_cpu_machine_is_node_zero_from_sysfs():
    node_dir = Path("/sys/devices/system/node")
    if not (node_dir / "node0" / "cpulist").exists():
        pytest.skip("this kernel exposes no NUMA nodes in sysfs")
    node0 = parse_cpulist((node_dir / "node0" / "cpulist").read_text())
    plan = plan_pinning("node", device_type="cpu")
    assert plan.source == "numa-node" and plan.numa_node == 0
    assert list(plan.main_cpus) == sorted(set(node0) & set(ALLOWED))
    assert plan.worker_cpus == plan.main_cpus
    if len(numa_nodes()) == 1:  # every local rank shares the only node
        assert plan_pinning("node", device_type="cpu", local_rank=3) == plan


def _fake_node_tree(root: Path, cpulists: list[str]) -> Path:
    # A sysfs tree read by the real sysinfo readers: node<i>/cpulist.
    for i, cpus in enumerate(cpulists):
        (root / "devices" / "system" / "node" / f"node{i}").mkdir(parents=True)
        (root / "devices" / "system" / "node" / f"node{i}" / "cpulist").write_text(cpus + "\n")
    return root


@needs_two_cpus
def test_node_rank_wraps_over_nodes_with_cpus(tmp_path):
    a, b = ALLOWED[0], ALLOWED[1]
    nodes = numa_nodes(_fake_node_tree(tmp_path, [str(a), "", str(b)]))  # node1: memory only
    host = probe_host().model_copy(update={"numa_nodes": nodes})
    plans = [plan_pinning("node", device_type="cpu", local_rank=r, probe=host) for r in range(4)]
    assert [p.main_cpus for p in plans] == [(a,), (b,), (a,), (b,)]
    assert [p.numa_node for p in plans] == [0, 2, 0, 2]


def _probe_with_gpu(affinity: list[int] | None, bus_id: str, numa_node: int | None) -> LocalProbe:
    gpu = GpuInfo(index=0, name="test GPU", uuid="GPU-0", memory_bytes=1 << 30, driver_version="0",
                  pci_bus_id=bus_id, cpu_affinity=affinity, numa_node=numa_node)
    return LocalProbe(**probe_host().model_dump(), nvml_available=True, note="one GPU", gpus=[gpu],
                      topology=[["X"]], visible_gpus=[0])


@needs_two_cpus
def test_cuda_node_uses_the_gpu_affinity_then_pci_local_cpulist():
    nvml = _probe_with_gpu([ALLOWED[1], 4096], "0000:00:00.0", 0)
    plan = plan_pinning("node", device_type="cuda", probe=nvml)
    assert plan.main_cpus == (ALLOWED[1],) and plan.source == "nvml"  # 4096 is not usable here: dropped
    pci = sorted(Path("/sys/bus/pci/devices").glob("*/local_cpulist"))
    if not pci:
        pytest.skip("no PCI device with a local_cpulist in sysfs")
    bus_id = pci[0].parent.name
    plan = plan_pinning("node", device_type="cuda", probe=_probe_with_gpu(None, bus_id, None))
    assert plan.source == "sysfs-pci"
    assert list(plan.main_cpus) == sorted(set(parse_cpulist(pci[0].read_text())) & set(ALLOWED))
    with pytest.raises(SpecError, match="local rank 1 has no GPU"):
        plan_pinning("node", device_type="cuda", local_rank=1, probe=nvml)


def test_none_mode_and_bad_inputs():
    assert plan_pinning("none", device_type="cpu") is None
    with pytest.raises(SpecError, match="allowed: cpu, cuda"):
        plan_pinning("node", device_type="mps")
    with pytest.raises(SpecError, match="choose from none, node, cpus"):
        plan_pinning("numa", device_type="cpu")  # type: ignore[arg-type]


def test_plan_rejects_unsorted_or_repeated_cpus():
    from pydantic import ValidationError

    for cpus in [(1, 0), (0, 0), (-1,), ()]:
        with pytest.raises(ValidationError):
            PinPlan(main_cpus=cpus, worker_cpus=(0,), numa_node=None, source="explicit")

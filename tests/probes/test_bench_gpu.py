"""The CUDA side of the machine bench and of pinning: needs a GPU, skipped without one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _need_gpu():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine: "
                    "the CUDA bench and GPU-local pinning are checked only where one exists")


def test_bench_measures_every_cuda_dtype_and_both_host_copies():
    import torch

    from probes.bench import run_bench
    from probes.bench_kernels import COPY_BYTES

    result = run_bench(seconds=4)
    mm = {(m.device, m.dtype): m for m in result.matmul}
    want = ["fp32", "tf32", "fp16"] + (["bf16"] if torch.cuda.is_bf16_supported(including_emulation=False) else [])
    for dtype in want:
        assert mm[("cuda:0", dtype)].tflops > 0
    if torch.cuda.get_device_capability(0) >= (8, 0):  # TF32 tensor cores: Ampere and later
        assert mm[("cuda:0", "tf32")].tflops > 1.5 * mm[("cuda:0", "fp32")].tflops
    (copy,) = [c for c in result.memory if c.device == "cuda:0"]
    assert copy.tensor_bytes == COPY_BYTES["cuda"] and copy.bytes_counted == 2 * copy.tensor_bytes
    h2d = {c.kind: c for c in result.host_to_device if c.device == "cuda:0"}
    assert set(h2d) == {"h2d-pinned", "h2d-pageable"} and result.host_to_device_note is None
    assert h2d["h2d-pinned"].gb_per_s > h2d["h2d-pageable"].gb_per_s  # pageable goes through a staging buffer
    assert copy.gb_per_s > h2d["h2d-pinned"].gb_per_s  # device memory outruns PCIe/NVLink-C2C


def test_node_pinning_uses_the_gpu_local_cpus():
    from advisor.hardware.probe import probe_local
    from probes.pinning import plan_pinning

    probe = probe_local()
    if not probe.visible_gpus:
        pytest.skip(f"NVML sees no GPU here ({probe.note})")
    plan = plan_pinning("node", device_type="cuda", probe=probe)
    gpu = next(g for g in probe.gpus if g.index == probe.visible_gpus[0])
    assert plan.source in ("nvml", "sysfs-pci", "numa-node")
    assert set(plan.main_cpus) <= os.sched_getaffinity(0)
    if gpu.cpu_affinity:
        assert list(plan.main_cpus) == sorted(set(gpu.cpu_affinity) & os.sched_getaffinity(0))
    script = textwrap.dedent("""
        import os
        import torch
        from probes.pinning import apply_pinning, plan_pinning, verify_pinning
        plan = plan_pinning("node", device_type="cuda")
        apply_pinning(plan, limit_threads=True)
        torch.zeros(1, device="cuda")  # CUDA context creation starts threads: they inherit the pinning
        assert verify_pinning(plan) == [], verify_pinning(plan)
        print(sorted(os.sched_getaffinity(0)) == list(plan.main_cpus))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"

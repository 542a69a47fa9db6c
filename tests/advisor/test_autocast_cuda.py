"""A CUDA target's trace follows CUDA autocast's op rules (advisor/estimate/autocast_cuda.py), checked against
torch's own CUDA autocast: fake tensors on a CUDA device carry the AutocastCUDA dispatch key even in a
CPU-only torch, so its real CUDA kernels' rules run on them here without a GPU."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from advisor.config import OptimizerKind, Precision
from advisor.estimate.autocast_cuda import cuda_policy, registered
from advisor.estimate.cuda_alloc import library_workspaces
from advisor.estimate.trace import trace_training
from advisor.workload import load_workload

HERE = Path(__file__).parent


def _ops(dev: str) -> dict:
    h, w = torch.empty(4, 32, device=dev), torch.empty(32, 32, device=dev)
    x, k = torch.empty(2, 8, 16, 16, device=dev), torch.empty(8, 8, 3, 3, device=dev)

    def lin():
        return F.linear(h, w)  # bf16 under either autocast

    return {
        "linear": lin, "gelu": lambda: F.gelu(lin()), "mean": lambda: lin().mean(-1),
        "layer_norm": lambda: F.layer_norm(lin(), (32,)), "rms_norm": lambda: F.rms_norm(lin(), (32,)),
        "group_norm": lambda: F.group_norm(F.conv2d(x, k, padding=1), 4),
        "softmax": lambda: lin().softmax(-1), "log_softmax": lambda: F.log_softmax(lin(), -1),
        "exp": lambda: lin().exp(), "pow": lambda: lin().pow(2), "rsqrt": lambda: torch.rsqrt(lin()),
        "sum": lambda: lin().sum(-1), "vector_norm": lambda: torch.linalg.vector_norm(lin(), dim=-1),
        "interpolate": lambda: F.interpolate(F.conv2d(x, k), scale_factor=2, mode="bilinear"),
        "mv": lambda: torch.mv(w, torch.empty(32, device=dev)),
        "addcmul": lambda: torch.addcmul(lin(), h, h),
        "cross_entropy": lambda: F.cross_entropy(lin(), torch.zeros(4, dtype=torch.long, device=dev)),
    }


def _dtypes(dev: str, policy: bool) -> dict[str, torch.dtype]:
    out = {}
    with FakeTensorMode(allow_non_fake_inputs=True):
        if dev == "cuda":  # torch.autocast("cuda") turns itself off without a GPU; the switch beneath it does not
            torch.set_autocast_enabled("cuda", True)
            torch.set_autocast_dtype("cuda", torch.bfloat16)
            try:
                out = {name: f().dtype for name, f in _ops("cuda").items()}
            finally:
                torch.set_autocast_enabled("cuda", False)
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16), cuda_policy() if policy else contextlib.nullcontext():
                out = {name: f().dtype for name, f in _ops("cpu").items()}
    return out


def test_the_rules_are_cuda_autocasts():
    cuda, ours, cpu = _dtypes("cuda", False), _dtypes("cpu", True), _dtypes("cpu", False)
    assert ours == cuda
    # where the two autocasts differ, which is why the policy exists: CPU's runs these in bf16 (mv in fp32)
    differ = {name for name in cuda if cpu[name] != cuda[name]}
    assert {"layer_norm", "group_norm", "softmax", "exp", "sum", "interpolate", "mv"} <= differ
    assert any(name.startswith("aten::layer_norm") for name in registered())


def test_outside_the_policy_cpu_autocast_is_unchanged():
    _dtypes("cpu", True)  # registers the kernels in this process
    assert _dtypes("cpu", False)["layer_norm"] == torch.bfloat16
    with FakeTensorMode(), torch.autocast("cpu", dtype=torch.bfloat16):
        h, w = torch.empty(4, 32), torch.empty(32, 32)
        assert F.layer_norm(F.linear(h, w), (32,)).dtype == torch.bfloat16


def test_a_cuda_targets_trace_keeps_softmax_probabilities_in_fp32():
    # hand-written attention over 1024 positions: on a GPU, bf16 autocast's softmax writes fp32
    # probabilities (4 MiB a sample) and the next einsum casts them to bf16 again
    wl = load_workload(f"{HERE / 'strided_attention.py'}:build")

    def peak(device: str) -> int:
        return trace_training(wl, 2, precision=Precision.bf16, optimizer=OptimizerKind.adamw, count_flops=False,
                              device=device).peak_bytes

    cpu, cuda = peak("cpu"), peak("cuda")
    assert cuda - cpu >= 2 * 1024 * 1024 * 2
    # fp32 has no autocast region: the same trace either way
    assert trace_training(wl, 2, precision=Precision.fp32, optimizer=OptimizerKind.adamw, count_flops=False,
                          device="cuda").peak_bytes == trace_training(
        wl, 2, precision=Precision.fp32, optimizer=OptimizerKind.adamw, count_flops=False).peak_bytes


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_cuda_estimate_traces_under_cudas_rules(precision):
    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory

    spec = f"{HERE / 'strided_attention.py'}:build"
    gpu = estimate_memory(spec, "h100-sxm", EstimateRequest(batch_size=2, precision=precision),
                          EstimateOptions(measured=False))
    plain = trace_training(load_workload(spec), 2, precision=Precision(precision), optimizer=OptimizerKind.adamw,
                           count_flops=False, optimizer_impl="foreach")
    workspaces = sum(n for _, n in library_workspaces("h100-sxm", plain.cublas_at, plain.cublas_threads))
    # the estimate's activations exceed what CPU autocast's trace holds at its peak, the cuBLAS workspaces aside
    assert gpu.allocated_bytes > plain.peak_bytes + 2 * 1024 * 1024 * 2
    assert gpu.allocated_bytes - workspaces > plain.peak_bytes + 2 * 1024 * 1024 * 2

"""Estimates for a CUDA target against real CUDA peaks (docs/design.md): needs a GPU, skipped without one."""

from __future__ import annotations

import pytest

from advisor.config import Precision
from advisor.measure import MeasureRequest, measure

pytestmark = pytest.mark.gpu


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture(scope="module", autouse=True)
def _need_gpu():
    if not _cuda_available():
        pytest.skip("no CUDA GPU on this machine: the CUDA estimate is checked only where one exists")


@pytest.mark.parametrize("workload,batch,precision",
                         [("gpt2-small", 4, Precision.bf16), ("resnet50", 32, Precision.fp32)])
def test_cuda_estimate_within_12_percent_of_measured(workload, batch, precision):
    from advisor.estimate import EstimateRequest, estimate_memory
    from advisor.hardware import get_hardware

    hw = get_hardware("local")
    est = estimate_memory(workload, hw, EstimateRequest(batch_size=batch, precision=precision))
    real = measure(MeasureRequest(workload=workload, batch_size=batch, precision=precision, mode="cuda"))
    assert est.predicts == "cuda_reserved"
    assert abs(est.allocated_bytes - real.alloc_peak_bytes) / real.alloc_peak_bytes < 0.12
    assert abs(est.total_bytes - real.cuda_reserved_bytes) / real.cuda_reserved_bytes < 0.12


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.bf16])
def test_cudnn_convolution_workspaces_are_sized_on_the_gpu(precision):
    """cuDNN's convolution workspaces come from the caching allocator inside the op; the CPU's fake
    ops know nothing of them. On this machine's GPU they are sized by running each shape once, which
    brings the allocated peak closer to the measured one than the trace without them."""
    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory
    from advisor.hardware import get_hardware

    hw = get_hardware("local")
    sized = estimate_memory("resnet18", hw, EstimateRequest(batch_size=64, precision=precision))
    unsized = estimate_memory("resnet18", hw, EstimateRequest(batch_size=64, precision=precision),
                              EstimateOptions(calibrate=False))
    real = measure(MeasureRequest(workload="resnet18", batch_size=64, precision=precision, mode="cuda"))
    assert any("CUDA op shape(s)" in n for n in sized.notes), sized.notes
    assert not any("cuDNN" in n for n in unsized.notes)
    err = abs(sized.allocated_bytes - real.alloc_peak_bytes) / real.alloc_peak_bytes
    assert err < abs(unsized.allocated_bytes - real.alloc_peak_bytes) / real.alloc_peak_bytes
    assert err < 0.05


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.bf16])
def test_cudnn_lstm_reserve_space_is_sized_on_the_gpu(precision):
    """cuDNN's LSTM keeps a reserve space from forward to backward (and takes workspaces inside each
    op) that the CPU trace's per-layer fake op reports as nothing: on this machine's GPU each layer's
    shapes run once through cuDNN, which brings the allocated peak within reach of the measured one."""
    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory
    from advisor.hardware import get_hardware

    hw = get_hardware("local")
    sized = estimate_memory("lstm", hw, EstimateRequest(batch_size=128, precision=precision),
                            EstimateOptions(measured=False))
    unsized = estimate_memory("lstm", hw, EstimateRequest(batch_size=128, precision=precision),
                              EstimateOptions(calibrate=False, measured=False))
    real = measure(MeasureRequest(workload="lstm", batch_size=128, precision=precision, mode="cuda")).alloc_peak_bytes
    assert any("LSTM layers" in n for n in sized.notes), sized.notes
    assert sized.allocated_bytes > unsized.allocated_bytes
    err = abs(sized.allocated_bytes - real) / real
    assert err < abs(unsized.allocated_bytes - real) / real
    assert err < 0.05, (sized.allocated_bytes, real, sized.notes)


def test_a_reductions_buffer_is_sized_on_the_gpu():
    """A sum that splits each output over several blocks (a linear layer's bias gradient at a large
    batch) takes a buffer for partial results inside its kernel: on this machine's GPU each reduction
    shape runs once (the default), or, not calibrating, its size is worked out from torch's launch rules
    (cuda_reduce.py); either brings the allocated peak within reach of the measured one."""
    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory
    from advisor.hardware import get_hardware

    hw = get_hardware("local")
    sized = estimate_memory("mlp", hw, EstimateRequest(batch_size=4096), EstimateOptions(measured=False))
    worked_out = estimate_memory("mlp", hw, EstimateRequest(batch_size=4096),
                                 EstimateOptions(calibrate=False, measured=False))
    real = measure(MeasureRequest(workload="mlp", batch_size=4096, mode="cuda")).alloc_peak_bytes
    assert any("reduction shape(s)" in n for n in worked_out.notes), worked_out.notes
    for est in (sized, worked_out):
        assert abs(est.allocated_bytes - real) / real < 0.03, (est.allocated_bytes, real, est.notes)


def _reductions():
    import torch

    aten = torch.ops.aten

    def t(*shape, dtype=torch.float32):
        return torch.zeros(shape, dtype=dtype, device="cuda")

    return [
        ("bias gradient fp32", aten.sum.dim_IntList, lambda: (t(4096, 2048), [0], False)),
        ("bias gradient bf16", aten.sum.dim_IntList, lambda: (t(32768, 2048, dtype=torch.bfloat16), [0], True)),
        ("narrow head", aten.sum.dim_IntList, lambda: (t(32768, 10, dtype=torch.bfloat16), [0], True)),
        ("rows", aten.sum.dim_IntList, lambda: (t(4096, 2048), [1], False)),
        ("two of three dims", aten.mean.dim, lambda: (t(32, 512, 768, dtype=torch.bfloat16), [0, 1], False)),
        ("middle dim", aten.sum.dim_IntList, lambda: (t(8, 4096, 256), [1], False)),
        ("a view one element in", aten.sum.dim_IntList,
         lambda: (t(32768 * 2048 + 1, dtype=torch.bfloat16)[1:].view(32768, 2048), [0], False)),
        ("everything", aten.sum.default, lambda: (t(1 << 24),)),
        ("variance", aten.var.correction, lambda: (t(16384, 1024), [0])),
        ("amax", aten.amax.default, lambda: (t(16384, 1024, dtype=torch.bfloat16), [0])),
        ("argmax", aten.argmax.default, lambda: (t(16384, 1024), 0)),
        ("norm", aten.linalg_vector_norm.default, lambda: (t(16384, 1024), 2, [0])),
    ]


@pytest.mark.parametrize("name", [name for name, *_ in _reductions()])
def test_a_reductions_scratch_worked_out_is_what_the_gpu_takes(name):
    """Each reduction's blocks taken and given back inside the op, in the caching allocator's history, against
    cuda_reduce.reduction_scratch for this GPU's multiprocessors (the catalog's estimates rest on it)."""
    import torch
    from torch.utils._pytree import tree_flatten

    from advisor.estimate.cuda_reduce import ReduceGpu, reduction_scratch

    _, func, make = next(r for r in _reductions() if r[0] == name)
    args = make()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=10_000)
    try:
        out = func(*args)
        torch.cuda.synchronize()
        events = torch.cuda.memory._snapshot()["device_traces"][0]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    kept = {t.data_ptr() for t in tree_flatten(out)[0]}
    freed = {ev["addr"] for ev in events if ev["action"] == "free_requested"}
    taken = [ev["size"] for ev in events if ev["action"] == "alloc" and ev["addr"] in freed - kept]
    assert reduction_scratch(func, args, {}, out, ReduceGpu.on_device()) == taken


def test_a_kernels_contiguous_copy_of_a_strided_input_is_sized_on_the_gpu():
    """einsum attention hands softmax's backward a transposed gradient; where its kernel copies that to a
    contiguous buffer, the copy comes from the caching allocator inside the op, which no dispatch mode
    sees: the estimate for this machine's GPU runs such ops once on zeros of the same strides."""
    from pathlib import Path

    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory
    from advisor.hardware import get_hardware

    spec = f"{Path(__file__).with_name('strided_attention.py')}:build"
    hw = get_hardware("local")
    probed = estimate_memory(spec, hw, EstimateRequest(batch_size=16), EstimateOptions(measured=False))
    plain = estimate_memory(spec, hw, EstimateRequest(batch_size=16), EstimateOptions(calibrate=False, measured=False))
    real = measure(MeasureRequest(workload=spec, batch_size=16, mode="cuda")).alloc_peak_bytes
    err = abs(probed.allocated_bytes - real) / real
    assert err <= abs(plain.allocated_bytes - real) / real
    assert err < 0.03, (probed.allocated_bytes, real, probed.notes)


def test_the_trace_moves_a_model_to_the_gpu_as_to_cuda_does():
    """bert-base's build, moved by a real `.to("cuda")` and recorded by the caching allocator's history:
    the same requests, in the same order, as the CUDA target's trace starts with (its MLM decoder's own
    weight, replaced by the tied embedding in the constructor, never reaches the device)."""
    import torch

    from advisor.config import OptimizerKind
    from advisor.estimate.trace import trace_training
    from advisor.workload import load_workload

    wl = load_workload("bert-base", {"seq_len": 128})
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        model = wl.build_model().to("cuda")
        events = torch.cuda.memory._snapshot()["device_traces"][0]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    real = [ev["size"] for ev in events if ev["action"] == "alloc"]  # the bytes asked for, as the trace's
    traced = trace_training(wl, 2, precision=Precision.fp32, optimizer=OptimizerKind.adamw, device="cuda",
                            count_flops=False)
    ours = [int(s) for s in traced.sizes[:len(real)]]
    assert ours == real
    assert sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers()) == sum(ours)

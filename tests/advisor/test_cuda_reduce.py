"""A CUDA reduction's cross-block scratch, worked out without a GPU (advisor/estimate/cuda_reduce.py), against
what real GPUs took, and the estimate for a catalog GPU that counts it against a real H200's peaks."""

from __future__ import annotations

import pytest
import torch

from advisor.estimate.cuda_reduce import ReduceGpu, reduction_scratch
from advisor.hardware import get_hardware
from advisor.hardware.catalog import CATALOG

aten = torch.ops.aten
H200 = ReduceGpu.of(CATALOG["h200"])
H100 = ReduceGpu.of(CATALOG["h100-sxm"])


def _sum(x: torch.Tensor, dims: list[int], gpu: ReduceGpu) -> list[int]:
    out = aten.sum.dim_IntList(x, dims, True)
    return reduction_scratch(aten.sum.dim_IntList, (x, dims, True), {}, out, gpu)


@pytest.mark.parametrize("shape,dtype,gpu,blocks", [
    # an H200's allocator events, mlp bf16 adamw at batch 32768 (bench/results/archive/cuda-events-h200): each
    # 2048-wide layer's bias gradient, then the 10-wide head's
    ((32768, 2048), torch.bfloat16, H200, [138_412_032, 64]),
    ((32768, 10), torch.bfloat16, H200, [10_240, 8]),
    # an H100's allocator events, the same sum at batch 4096: 64 MiB in both dtypes
    ((4096, 2048), torch.float32, H100, [64 << 20, 64]),
    ((4096, 2048), torch.bfloat16, H100, [64 << 20, 64]),
])
def test_a_bias_gradients_scratch_is_what_the_gpu_took(shape, dtype, gpu, blocks):
    assert _sum(torch.empty(shape, dtype=dtype, device="meta"), [0], gpu) == blocks


def test_the_scratch_follows_the_gpus_multiprocessors_and_the_reductions_layout():
    x = torch.empty(32768, 2048, dtype=torch.bfloat16, device="meta")
    # blocks per output: as many as fill the device (132 on an H200, 108 on an A100), so the buffer follows it
    a100 = _sum(x, [0], ReduceGpu.of(CATALOG["a100-80gb"]))[0]
    assert a100 == _sum(x, [0], H200)[0] * 108 // 132
    # a sum along each row (a softmax's, a loss's) finishes each output within one block: none
    assert _sum(x, [1], H200) == []
    # a view one element in: the output vector narrows to one lane, and each output takes fewer blocks
    offset = torch.empty(32768 * 2048 + 1, dtype=torch.bfloat16, device="meta")[1:].view(32768, 2048)
    assert 0 < _sum(offset, [0], H200)[0] < _sum(x, [0], H200)[0] // 10
    # a sum of everything: partial results only per block, one output
    whole = torch.empty(1 << 24, device="meta")
    buffer, semaphores = reduction_scratch(aten.sum.default, (whole,), {}, aten.sum.default(whole), H200)
    assert buffer < 4096 and semaphores == 4


def test_every_gpu_in_the_catalog_has_its_multiprocessors():
    for acc in CATALOG.values():
        if acc.vendor != "cpu":
            assert ReduceGpu.of(acc) is not None, acc.name
    assert ReduceGpu.of(CATALOG["mi300x"]).warp_size == 64 and ReduceGpu.of(CATALOG["mi300x"]).rocm
    assert ReduceGpu.of(CATALOG["cpu"]) is None


@pytest.mark.parametrize("precision,optimizer,batch,reserved", [
    # real max_memory_reserved on an H200 (bench/results/accuracy-cuda-h200.json and
    # archive/cuda-events-h200/peaks.jsonl); without the reductions' scratch this estimate is -14.6% and -10.7%
    ("fp32", "adamw", 4096, 459_276_288),
    ("bf16", "adamw", 32768, 1_329_594_368),
])
def test_an_estimate_for_a_catalog_gpu_counts_its_reductions_scratch(precision, optimizer, batch, reserved):
    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory

    est = estimate_memory("mlp", get_hardware("h200"),
                          EstimateRequest(batch_size=batch, precision=precision, optimizer=optimizer),
                          EstimateOptions(measured=False))
    assert abs(est.total_bytes - reserved) / reserved < 0.01, (est.total_bytes, reserved)
    assert any("reduction shape(s)" in n for n in est.notes), est.notes


def test_a_catalog_gpus_estimate_says_which_cudnn_workspaces_it_leaves_out():
    """A convolution net or an LSTM for a catalog GPU: cuDNN's workspaces follow the algorithm it picks on the
    device, which no trace here can know; the estimate says it leaves them out, and how many shapes."""
    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory

    for workload in ("tiny-unet", "tiny-lstm"):
        notes = estimate_memory(workload, get_hardware("h200"), EstimateRequest(batch_size=4),
                                EstimateOptions(measured=False)).notes
        assert any(n.startswith("cuDNN's workspaces for") and "not counted" in n for n in notes), notes
    notes = estimate_memory("tiny-mlp", get_hardware("h200"), EstimateRequest(batch_size=4),
                            EstimateOptions(measured=False)).notes
    assert not any("cuDNN" in n for n in notes), notes


def test_the_batch_model_works_a_reductions_scratch_out_again_at_each_batch():
    """The scratch is not affine in the batch: none below 1024 rows for a 256-wide bias gradient, then growing
    with the rows until its blocks fill the GPU. From traces at 512 and 1024 rows (none, then 2 MiB a layer),
    the batch model's scratch at 131072 is the exact trace's there (132 MiB), not the line's (510 MiB)."""
    import numpy as np

    from advisor.config import OptimizerKind, Precision
    from advisor.estimate.batchmodel import BatchModel
    from advisor.estimate.trace import trace_training
    from advisor.workload import load_workload

    wl = load_workload("tiny-mlp", {})

    def trace(b):
        return trace_training(wl, b, precision=Precision.bf16, optimizer=OptimizerKind.adamw, device="cuda",
                              reduce_gpu=H200, optimizer_impl="foreach", count_flops=False)

    small, large = trace(512), trace(1024)
    bm = BatchModel(a=1024, trace_a=large, c=512, trace_c=small)
    exact, modelled = trace(131072), bm.at(131072)
    scratch = {aid for aid, slot, _ in large.reduce_specs if slot == 1}

    def blocks(tr):
        return sorted(int(n) for n, aid in zip(tr.sizes, tr.ids) if aid in scratch and n > 0)

    assert blocks(small) == [] and max(blocks(large)) == 2 << 20
    assert blocks(modelled) == blocks(exact) and max(blocks(exact)) == 132 << 20
    assert modelled.peak_bytes == exact.peak_bytes
    assert np.abs(modelled.sizes).sum() == np.abs(exact.sizes).sum()

"""The CUDA caching-allocator replay (pure: sequences of allocations and frees, no GPU) and the
choices a CUDA target's trace makes (optimizer implementation, cuBLAS workspaces)."""

from __future__ import annotations

import numpy as np

from advisor.config import OptimizerKind, Precision
from advisor.estimate.cuda_alloc import MB, cublas_workspace_bytes, library_workspaces, simulate_cuda, with_workspaces


def _replay(*events: tuple[str, int, int]) -> tuple[int, int]:
    """('+', id, bytes) allocates, ('-', id, bytes) frees."""
    sizes = np.asarray([n if op == "+" else -n for op, _, n in events], np.int64)
    ids = np.asarray([i for _, i, _ in events], np.int64)
    return simulate_cuda(sizes, ids)


def test_small_requests_round_to_512_bytes_inside_one_2_mib_segment():
    alloc, reserved = _replay(("+", 0, 1), ("+", 1, 700), ("+", 2, 513))
    assert alloc == 512 + 1024 + 1024
    assert reserved == 2 * MB


def test_adjacent_freed_blocks_merge_so_a_larger_request_reuses_them():
    # two 8 MiB blocks split from one 20 MiB segment, both freed: one free 20 MiB block again,
    # which a 14 MiB request takes without a new segment
    alloc, reserved = _replay(("+", 0, 8 * MB), ("+", 1, 8 * MB), ("-", 0, 8 * MB), ("-", 1, 8 * MB),
                              ("+", 2, 14 * MB))
    assert reserved == 20 * MB
    assert alloc == 16 * MB


def test_a_free_block_between_live_ones_does_not_merge():
    # 0 and 2 stay live around the freed 1: the 12 MiB request needs a segment of its own
    alloc, reserved = _replay(("+", 0, 6 * MB), ("+", 1, 6 * MB), ("+", 2, 6 * MB), ("-", 1, 6 * MB),
                              ("+", 3, 12 * MB))
    assert reserved == 20 * MB + 12 * MB
    assert alloc == 12 * MB + 12 * MB


def test_best_fit_takes_the_smallest_free_block_that_fits():
    # free blocks of 12 MiB (own segment) and 30 MiB (own segment): a 12 MiB request takes the
    # first, so a later 30 MiB request still finds its block and nothing new is reserved
    _, reserved = _replay(("+", 0, 12 * MB), ("+", 1, 30 * MB), ("-", 0, 12 * MB), ("-", 1, 30 * MB),
                          ("+", 2, 12 * MB), ("+", 3, 30 * MB))
    assert reserved == 42 * MB


def test_cublas_workspaces_are_larger_from_hopper_on():
    assert cublas_workspace_bytes("h100-sxm") == 2 * 32 * MB
    assert cublas_workspace_bytes("a100-80gb") < cublas_workspace_bytes("h100-sxm")


def test_a_cuda_target_traces_the_foreach_optimizer_and_counts_the_workspaces():
    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory

    # batch 2: the optimizer step holds the peak. torch's CUDA default, foreach, keeps an intermediate
    # of every parameter at once (40 MB here), the per-parameter loop one of the largest (17 MB)
    cpu_like = estimate_memory("mlp", "h100-sxm",
                               EstimateRequest(batch_size=2, optimizer="adamw", optimizer_impl="for-loop"),
                               EstimateOptions(measured=False))
    default = estimate_memory("mlp", "h100-sxm", EstimateRequest(batch_size=2, optimizer="adamw"),
                              EstimateOptions(measured=False))
    assert default.allocated_bytes - cpu_like.allocated_bytes > 4 * MB
    assert default.breakdown.temporaries >= cublas_workspace_bytes("h100-sxm")
    assert default.allocated_bytes >= cublas_workspace_bytes("h100-sxm") + default.breakdown.parameters


def test_only_threads_that_multiply_matrices_hold_a_cublas_workspace():
    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory
    from advisor.estimate.trace import trace_training
    from advisor.workload import load_workload

    def threads(name: str) -> int:
        return trace_training(load_workload(name), 2, precision=Precision.fp32, optimizer=OptimizerKind.adamw,
                              count_flops=False).cublas_threads

    # convolutions only (cuDNN's): no thread takes a cuBLAS handle; a Linear layer: the forward's thread
    # and autograd's backward thread both do
    assert threads("tiny-unet") == 0
    assert threads("tiny-mlp") == 2
    unet = estimate_memory("tiny-unet", "h100-sxm", EstimateRequest(batch_size=2), EstimateOptions(measured=False))
    mlp = estimate_memory("tiny-mlp", "h100-sxm", EstimateRequest(batch_size=2), EstimateOptions(measured=False))
    assert unet.breakdown.temporaries < cublas_workspace_bytes("h100-sxm", 1)
    assert mlp.breakdown.temporaries >= cublas_workspace_bytes("h100-sxm")


def test_a_workspace_taken_from_a_cached_block_splits_it():
    # The order seen on an H200 (resnet18 fp32 sgd-momentum b64): a 196 MiB activation is freed, the
    # first matrix product takes its 32 MiB cuBLAS workspace from the cached block, and the next 196 MiB
    # request no longer fits there: a new segment. With the workspace in a segment of its own, an estimate
    # would miss that segment (the real run reserves 2140 MiB, replayed exactly; 2009 without the split).
    sizes = np.array([196 * MB, -196 * MB, 196 * MB])
    ids = np.array([0, 0, 1])
    at_op = library_workspaces("h100-sxm", ((2, "cublas"),), 1)
    assert at_op == [(2, 32 * MB)]
    placed = with_workspaces(sizes, ids, at_op)
    assert placed[0].tolist() == [196 * MB, -196 * MB, 32 * MB, 196 * MB]
    assert set(placed[1].tolist()) == {0, 1, 2}
    assert simulate_cuda(*placed) == (228 * MB, 392 * MB)
    assert simulate_cuda(sizes, ids)[1] + 32 * MB == 228 * MB
    # without a recorded place (an analytic trace), one workspace per thread, each outside the pool
    assert library_workspaces("a100-80gb", (), 2) == [(None, cublas_workspace_bytes("a100-80gb", 1))] * 2


def test_the_trace_records_where_each_thread_first_multiplies_matrices():
    from advisor.estimate import EstimateOptions, EstimateRequest, estimate_memory
    from advisor.estimate.trace import trace_training
    from advisor.workload import load_workload

    def trace(name: str):
        return trace_training(load_workload(name), 2, precision=Precision.fp32, optimizer=OptimizerKind.adamw,
                              count_flops=False)

    mlp = trace("tiny-mlp")
    kinds = [kind for _, kind in mlp.cublas_at]
    # the forward's first Linear (addmm with a bias: cuBLASLt too), then backward's first matrix product
    assert kinds == ["cublas", "cublaslt", "cublas"]
    (fwd, _), (_, _), (bwd, _) = mlp.cublas_at
    assert fwd < bwd
    assert mlp.sizes[fwd - 1] > 0 and mlp.sizes[bwd - 1] > 0  # each taken right after its op's output
    # the LSTM's head runs on a 3-D input (matmul, no bias epilogue): no cuBLASLt workspace
    assert [kind for _, kind in trace("tiny-lstm").cublas_at] == ["cublas", "cublas"]
    assert trace("tiny-unet").cublas_at == ()
    est = estimate_memory("tiny-mlp", "h100-sxm", EstimateRequest(batch_size=2), EstimateOptions(measured=False))
    assert est.breakdown.temporaries >= 2 * cublas_workspace_bytes("h100-sxm", 1) + MB

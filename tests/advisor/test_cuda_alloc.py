"""The CUDA caching-allocator replay (pure: sequences of allocations and frees, no GPU) and the
choices a CUDA target's trace makes (optimizer implementation, cuBLAS workspaces)."""

from __future__ import annotations

import numpy as np

from advisor.config import OptimizerKind, Precision
from advisor.estimate.cuda_alloc import MB, cublas_workspace_bytes, simulate_cuda


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
    from advisor.estimate import estimate_memory

    # batch 2: the optimizer step holds the peak. torch's CUDA default, foreach, keeps an intermediate
    # of every parameter at once (40 MB here), the per-parameter loop one of the largest (17 MB)
    cpu_like = estimate_memory("mlp", "h100-sxm", 2, optimizer="adamw", optimizer_impl="for-loop", measured=False)
    default = estimate_memory("mlp", "h100-sxm", 2, optimizer="adamw", measured=False)
    assert default.allocated_bytes - cpu_like.allocated_bytes > 4 * MB
    assert default.breakdown.temporaries >= cublas_workspace_bytes("h100-sxm")
    assert default.allocated_bytes >= cublas_workspace_bytes("h100-sxm") + default.breakdown.parameters


def test_only_threads_that_multiply_matrices_hold_a_cublas_workspace():
    from advisor.estimate import estimate_memory
    from advisor.estimate.trace import trace_training
    from advisor.workload import load_workload

    def threads(name: str) -> int:
        return trace_training(load_workload(name), 2, precision=Precision.fp32, optimizer=OptimizerKind.adamw,
                              count_flops=False).cublas_threads

    # convolutions only (cuDNN's): no thread takes a cuBLAS handle; a Linear layer: the forward's thread
    # and autograd's backward thread both do
    assert threads("tiny-unet") == 0
    assert threads("tiny-mlp") == 2
    unet = estimate_memory("tiny-unet", "h100-sxm", 2, measured=False)
    mlp = estimate_memory("tiny-mlp", "h100-sxm", 2, measured=False)
    assert unet.breakdown.temporaries < cublas_workspace_bytes("h100-sxm", 1)
    assert mlp.breakdown.temporaries >= cublas_workspace_bytes("h100-sxm")

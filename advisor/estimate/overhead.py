"""What the allocator and the runtime add on top of live tensors on a CUDA device: the caching
allocator's rounding and cached segments (cuda_alloc), and the context outside it. A CPU's: resident/."""

from __future__ import annotations

from dataclasses import dataclass

from advisor.estimate.cuda_alloc import RUNTIME_BYTES, simulate_cuda, with_workspaces
from advisor.estimate.trace import Trace


@dataclass(frozen=True)
class Overhead:
    total: int  # predicted measured quantity (bytes)
    allocated: int  # predicted live-tensor peak (bytes)
    runtime: int  # bytes outside the allocator's count (CUDA context) (bytes)


# Reserved over allocated for a synthetic (formula) trace: segment rounding of large blocks.
SYNTHETIC_RESERVED_RATIO = 1.05


def cuda_overhead(trace: Trace, allocated: int, workspaces: list[tuple[int | None, int]] = ()) -> Overhead:
    """`allocated`: the traced live peak for the strategy; `workspaces`: library workspaces that the trace
    does not allocate and that stay allocated (cuBLAS's: `cuda_alloc.library_workspaces`), as (event index,
    bytes): taken from the pool before that event, or, without an index, each in a segment of its own."""
    workspace = sum(n for _, n in workspaces)
    if trace.synthetic:
        return Overhead(total=int(allocated * SYNTHETIC_RESERVED_RATIO) + workspace, allocated=allocated + workspace,
                        runtime=RUNTIME_BYTES)
    placed = sum(n for i, n in workspaces if i is not None)
    peak_alloc, peak_res = simulate_cuda(*with_workspaces(trace.sizes, trace.ids, list(workspaces)))
    # Rounding and caching grow the single-device figures; apply the same ratio to the strategy's (the
    # workspaces are the same on every device).
    scale = allocated / trace.peak_bytes if trace.peak_bytes else 1.0
    return Overhead(total=int((peak_res - placed) * scale) + workspace,
                    allocated=int((peak_alloc - placed) * scale) + workspace, runtime=RUNTIME_BYTES)

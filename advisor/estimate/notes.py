"""What an estimate says of how its trace was made: kernels run for their scratch, what fake tensors miss."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from advisor.estimate.cuda_reduce import ReduceGpu
    from advisor.estimate.trace import Trace
    from advisor.hardware.spec import HardwareSpec


def trace_notes(trace: Trace, workload: str, hw: HardwareSpec, reduce_gpu: ReduceGpu | None) -> list[str]:
    """The notes on `trace` (the request's, of the workload named `workload` for `hw`): what ran on a real
    device to size kernels' scratch, and what a fake-tensor trace could not see or had to bound."""
    notes = _sized_notes(trace, hw, reduce_gpu)
    if trace.unsized_cudnn:
        notes.append(f"cuDNN's workspaces for {trace.unsized_cudnn} convolution or LSTM op shape(s) are not "
                     "counted: their size follows the algorithm cuDNN picks on the device itself, so only an "
                     "estimate on that GPU (--hardware local, calibrating) sizes them (on an H200 the presets' "
                     "convolution nets and LSTM reserved up to 1.9 times the estimate without them)")
    if trace.init_skipped:
        notes.append(f"{workload}'s build reads its tensors' values, which fake tensors do not have (e.g. torch's "
                     "nn.init.trunc_normal_, a rejection loop): traced with torch.nn.init's initializers skipped, as "
                     "initial values change no memory")
    if trace.ctc_bounded:
        notes.append("ctc_loss's target lengths are a tensor, whose values fake tensors do not have: its alpha and "
                     "beta tables are sized for the longest target the targets' shape allows (exact where one is "
                     "that long; more otherwise)")
    return notes + _probed_notes(trace)


def _sized_notes(trace: Trace, hw: HardwareSpec, reduce_gpu: ReduceGpu | None) -> list[str]:
    """Kernels' scratch sized by running them, or (a GPU not at hand) worked out from torch's launch rules."""
    notes = []
    if trace.sized_kernels:
        where = ("CUDA op shape(s) (cuDNN's convolutions and LSTM layers, reductions) once on zeros on this machine's "
                 "GPU" if trace.sized_on == "cuda" else "op shape(s) (oneDNN's convolutions and LSTM layers, sparse "
                 "kernels) once on zeros on this CPU")
        notes.append(f"kernel scratch and workspaces sized by running {trace.sized_kernels} {where} "
                     "(fake ops report none)")
    if trace.reduce_scratch:
        notes.append(f"the cross-block scratch of {trace.reduce_scratch} reduction shape(s) (a linear layer's bias "
                     f"gradient, a sum over the batch) worked out from torch's launch rules for the "
                     f"{hw.accelerator.name}'s {reduce_gpu.multiprocessors} multiprocessors, at each batch size "
                     "(fake ops report none)")
    return notes


def _probed_notes(trace: Trace) -> list[str]:
    """Op shapes run once on zeros for the scratch their kernels hold inside themselves (dispatch shows none)."""
    notes = []
    if trace.probed_copies:
        where = "this machine's GPU" if trace.sized_on == "cuda" else "this CPU"
        notes.append(f"{trace.probed_copies} op shape(s) with strided inputs run once on zeros on {where}, for the "
                     "contiguous copies their kernels make inside themselves (dispatch shows none)")
    if trace.probed_reductions:
        notes.append(f"{trace.probed_reductions} reduction shape(s) run once on zeros on this CPU hold scratch "
                     "inside their kernels (a mean over a 16-bit input sums a float32 copy of it; dispatch shows none)")
    if trace.probed_products:
        notes.append(f"{trace.probed_products} 16-bit matrix product shape(s) run once on zeros on this CPU hold "
                     "scratch inside their kernels beside their output (oneDNN's buffer; dispatch shows none)")
    return notes


def exact_largest_reason(trace: Trace, cpu_uncalibrated: bool) -> str | None:
    """Why the largest batch is searched again on exact traces, or None: kernels' scratch that is not affine
    in the batch (workspaces sized on the GPU; on this CPU, uncalibrated, 16-bit products' scratch; a
    calibration's real runs near the answer take the CPU's in instead)."""
    if trace.sized_on == "cuda" and trace.sized_kernels:
        return ("cuDNN's workspaces sized at each (they follow the algorithm cuDNN picks for the shape, not a line in "
                "the batch)")
    if cpu_uncalibrated and trace.probed_products:
        return ("16-bit matrix products' scratch probed at each (oneDNN's buffer follows the blocking it picks for "
                "the shape, not a line in the batch)")
    return None

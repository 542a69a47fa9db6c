"""What CUDA kernels hold beyond their outputs: cuDNN's workspaces and LSTM reserve space and kernels' scratch,
sized on this machine's GPU, and reductions' scratch worked out for a GPU not at hand (cuda_reduce.py)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

from advisor.estimate.cuda_reduce import is_reduction, reduction_spec, scratch_slots
from advisor.estimate.kernel_probe import probe_key, probed_blocks, real_like

if TYPE_CHECKING:
    from advisor.estimate.trace import Tracker

# cuDNN's and ideep's enum for an LSTM (cudnnRNNMode_t CUDNN_LSTM; ideep::rnn_kind::LSTM), the one RNN
# kind that takes the CPU's mkldnn_rnn_layer path
_LSTM_MODE = 2


def cudnn_rnn_sizes(tracker: Tracker, tensors: tuple, hidden: int, mode: int,
                    has_biases: bool) -> tuple[int, int, int]:
    """cuDNN's LSTM on this machine's GPU for one layer of the shapes the CPU trace runs per layer (`tensors`: the
    first seven arguments of mkldnn_rnn_layer and of its backward, input (T, B, I), four weights, h0 and c0):
    (reserve space bytes, forward workspace bytes, backward workspace bytes). The reserve space is kept from
    forward to backward; each workspace is taken inside its op and freed before it returns. Measured once per
    shape on zeros, a workspace as the allocator's peak over what its op leaves allocated; 0 for what cannot run
    here. A real multi-layer LSTM runs all layers in one cuDNN call, whose reserve space also holds the layers'
    outputs the CPU trace keeps as tensors: taken per layer, the estimate counts those (L - 1) outputs twice."""
    import torch

    if mode != _LSTM_MODE:
        return 0, 0, 0
    key = probe_key(torch.ops.aten._cudnn_rnn.default, tensors)

    def size() -> tuple[int]:  # the reserve space; all three sizes go to tracker.rnn_sizes
        sizes = _run_cudnn_rnn(tracker, tensors, hidden, mode, has_biases)
        tracker.rnn_sizes[key] = sizes
        return sizes[:1]

    probed_blocks(tracker, torch.ops.aten._cudnn_rnn.default, tensors, {}, size)
    return tracker.rnn_sizes.get(key, (0, 0, 0))  # absent: inputs past PROBE_INPUT_LIMIT


def _run_cudnn_rnn(tracker: Tracker, tensors: tuple, hidden: int, mode: int,
                   has_biases: bool) -> tuple[int, int, int]:
    """`cudnn_rnn_sizes`' three sizes from one forward and one backward on zeros on the GPU; what could not run
    stays 0."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    inp, weights, hx, cx = tensors[0], tensors[1:5], tensors[5], tensors[6]
    tf32, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, tracker.cudnn_tf32
    sizes = (0, 0, 0)
    with unset_fake_temporarily():
        try:
            def zeros(t: Any, shape: tuple | None = None) -> Any:
                return torch.zeros(shape or t.shape, dtype=inp.dtype, device="cuda")

            x = zeros(inp)
            w = [zeros(t) for t in (weights if has_biases else weights[:2])]
            h0, c0 = zeros(hx, (1, *hx.shape)), zeros(cx, (1, *cx.shape))
            flat = dict(weight_stride0=len(w), mode=mode, hidden_size=hidden, proj_size=0, num_layers=1,
                        batch_first=False, dropout=0.0, train=True, bidirectional=False, batch_sizes=[],
                        dropout_state=None)
            out, forward = cuda_scratch_of(lambda: torch.ops.aten._cudnn_rnn(x, w, weight_buf=None, hx=h0,
                                                                             cx=c0, **flat))
            sizes = (int(out[3].nbytes), forward, 0)
            grad_out = torch.zeros_like(out[0])
            _, backward = cuda_scratch_of(lambda: torch.ops.aten._cudnn_rnn_backward(
                x, w, weight_buf=out[4], hx=h0, cx=c0, output=out[0], grad_output=grad_out, grad_hy=None,
                grad_cy=None, reserve=out[3], output_mask=[True, True, True, True], **flat))
            sizes = (*sizes[:2], backward)
        except Exception:  # noqa: BLE001 - no cuDNN or no room on the GPU now: what was sized stays, never a failed trace
            pass
        finally:
            torch.backends.cudnn.allow_tf32 = tf32
    return sizes


def cuda_scratch_of(call: Callable[[], Any]) -> tuple[Any, int]:
    """(call()'s result, the scratch it took on the GPU: the caching allocator's peak during the call
    over what stays allocated after it, its result included)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    result = call()
    torch.cuda.synchronize()
    return result, max(0, torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated())


def rnn_layer_reserve(tracker: Tracker, args: tuple, out: tuple) -> tuple:
    """An LSTM layer's forward on this machine's GPU: its outputs with cuDNN's reserve space as the workspace,
    then its forward workspace, taken after them and freed inside the op (`cudnn_rnn_sizes`)."""
    import torch

    workspace = out[3]
    # mkldnn_rnn_layer(input, w0..w3, hx, cx, reverse, batch_sizes, mode, hidden_size, num_layers, has_biases, ...)
    reserve, forward_scratch, _ = cudnn_rnn_sizes(tracker, args[:7], hidden=args[10], mode=args[9],
                                                  has_biases=args[12])
    if reserve != workspace.nbytes:
        workspace = torch.empty(reserve, dtype=torch.uint8, device=workspace.device)
        out = (*out[:3], workspace)
    tracker.track(workspace)
    for t in out[:3]:
        tracker.track(t)
    tracker.scratch(forward_scratch)
    return out


@functools.lru_cache(maxsize=1)
def _rnn_layer_backward() -> Any:
    import torch

    return torch.ops.aten.mkldnn_rnn_layer_backward.default


def is_rnn_layer_backward(tracker: Tracker, func: Any, args: tuple, kwargs: dict) -> bool:
    return func is _rnn_layer_backward()


def rnn_backward_scratch(tracker: Tracker, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """cuDNN's backward workspace for the layer `args` (mkldnn_rnn_layer_backward's, whose first seven
    arguments are its forward's), after the op's outputs (see `cudnn_rnn_sizes`)."""
    from torch.utils._pytree import tree_flatten

    for t in tree_flatten(out)[0]:
        tracker.track(t)
    # mkldnn_rnn_layer_backward(input, w0..w3, hx, cx, output, hy, cy, grad_output, grad_hy, grad_cy, reverse,
    #                           mode, hidden_size, num_layers, has_biases, ...)
    tracker.scratch(cudnn_rnn_sizes(tracker, args[:7], hidden=args[15], mode=args[14], has_biases=args[17])[2])
    return out


@functools.lru_cache(maxsize=1)
def _cuda_scratch_ops() -> frozenset:
    """Ops whose CUDA kernels take scratch from the caching allocator inside the op: cuDNN's convolutions (a
    workspace whose size comes from the algorithm cuDNN picks for the GPU, shape and dtype), and reductions, whose
    kernel (gpu_reduce_kernel) takes a buffer for partial results where it splits each output over several blocks
    (its size follows the launch configuration torch picks for the GPU and shape: on an H100, 64 MiB for the bias
    gradient of a 2048-wide linear layer at batch 4096, a sum over 32 MiB in fp32 and over 16 MiB in bf16 alike)."""
    import torch

    aten = torch.ops.aten
    reductions = {aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim, aten.nansum.default,
                  aten.prod.default, aten.prod.dim_int, aten.amax.default, aten.amin.default, aten.max.dim,
                  aten.min.dim, aten.argmax.default, aten.argmin.default, aten.linalg_vector_norm.default,
                  aten.var.correction, aten.std.correction, aten.var_mean.correction, aten.std_mean.correction,
                  aten.any.dim, aten.all.dim}
    return frozenset({aten.convolution.default, aten.convolution_backward.default, *reductions})


def is_cuda_scratch_op(tracker: Tracker, func: Any, args: tuple, kwargs: dict) -> bool:
    return func in _cuda_scratch_ops()


def cuda_scratch(tracker: Tracker, func: Any, args: tuple, kwargs: dict, out: Any, copy: bool = False) -> Any:
    """cuDNN's convolution workspace, a reduction's buffer (`_cuda_scratch_ops`) or a kernel's contiguous copy of
    a strided input (`kernel_probe.may_copy_strided`), which the CPU's fake ops know nothing of: the op runs once
    on zeros of the same shapes, strides and dtypes on this machine's GPU (the target), the scratch being the
    allocator's peak over what the op leaves allocated (its outputs). It is taken after the outputs and freed
    before the op returns: the trace records the outputs, then a fake allocation of its size that dies at once.
    `copy`: probed for a strided copy (counted apart, Trace.probed_copies)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
    from torch.utils._pytree import tree_flatten

    if not any(isinstance(a, FakeTensor) for a in tree_flatten((args, kwargs))[0]):
        return out

    def size() -> tuple[int]:
        # cuDNN's algorithm as training picks it, with or without TF32
        tf32, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, tracker.cudnn_tf32
        with unset_fake_temporarily():
            try:
                real, real_kwargs = real_like((args, kwargs), "cuda")
                return (cuda_scratch_of(lambda: func(*real, **real_kwargs))[1],)
            except Exception:  # noqa: BLE001 - no kernel or no room for it on the GPU now: nothing sized, never a failed trace
                return (0,)
            finally:
                torch.backends.cudnn.allow_tf32 = tf32

    n = probed_blocks(tracker, func, args, kwargs, size, counted_in=tracker.copy_probes if copy else None)
    for t in tree_flatten(out)[0]:
        tracker.track(t)
    tracker.scratch(*n)
    return out


def strided_copy_scratch(tracker: Tracker, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    return cuda_scratch(tracker, func, args, kwargs, out, copy=True)


def is_remote_reduction(tracker: Tracker, func: Any, args: tuple, kwargs: dict) -> bool:
    return is_reduction(func)


def reduction_scratch(tracker: Tracker, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """A reduction on a CUDA target not at hand: after its outputs, the blocks its kernel holds while it runs
    (`cuda_reduce.scratch_slots`, from torch's launch rules and the GPU's multiprocessors: partial results and
    semaphores, and an accumulation buffer before them for a huge 16-bit one), freed as it returns, the last
    taken first. All three are recorded for every reduction, 0 bytes where it takes none, so that two traces'
    allocations keep their order (batchmodel.py)."""
    from torch.utils._pytree import tree_flatten

    for t in tree_flatten(out)[0]:
        tracker.track(t)
    spec = reduction_spec(func, args, kwargs, out)
    sizes = scratch_slots(spec, tracker.reduce_gpu) if spec is not None else (0, 0, 0)
    if any(sizes):
        tracker.reduce_scratch.add(spec)
    for slot, aid in enumerate(tracker.scratch(*sizes)):
        if spec is not None:
            tracker.reduce_specs.append((aid, slot, spec))
    return out


@functools.lru_cache(maxsize=1)
def _cudnn_ops() -> frozenset:
    """Ops that run on cuDNN on a CUDA target, with a workspace (and an LSTM's reserve space) whose size
    follows the algorithm cuDNN picks on the device (the CPU trace runs oneDNN's LSTM layer by layer)."""
    import torch

    aten = torch.ops.aten
    return frozenset({aten.convolution.default, aten.convolution_backward.default, aten.mkldnn_rnn_layer.default,
                      aten.mkldnn_rnn_layer_backward.default})


def is_cudnn_op(tracker: Tracker, func: Any, args: tuple, kwargs: dict) -> bool:
    return func in _cudnn_ops()


def note_unsized_cudnn(tracker: Tracker, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """A cuDNN op on a GPU not at hand: its workspace is left unsized, and its shape counted (Trace.unsized_cudnn)."""
    tracker.unsized_cudnn.add(probe_key(func, args, kwargs))
    return out


@functools.lru_cache(maxsize=1)
def cublas_ops() -> frozenset:
    """aten ops whose CUDA kernels are cuBLAS calls (matrix products; `linear` and `matmul` reach dispatch as
    these), so the thread that runs one takes a cuBLAS handle and its workspace. Convolutions (cuDNN), attention
    kernels (flash, memory-efficient) and cuDNN's RNN do not."""
    import torch

    aten = torch.ops.aten
    return frozenset({aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.addbmm, aten.mv, aten.addmv, aten.dot,
                      aten.vdot, aten._addmm_activation, aten._scaled_mm, aten._int_mm})


def runs_on_cublaslt(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether torch's CUDA kernel for this matrix product goes through cuBLASLt (which takes a workspace of
    its own): addmm and _addmm_activation adding a bias vector with beta 1 (`linear` with a bias), and the
    scaled (fp8) products."""
    import torch

    aten = torch.ops.aten
    if func.overloadpacket is aten._scaled_mm:
        return True
    return (func in (aten.addmm.default, aten._addmm_activation.default) and isinstance(args[0], torch.Tensor)
            and args[0].dim() == 1 and kwargs.get("beta", 1) == 1)

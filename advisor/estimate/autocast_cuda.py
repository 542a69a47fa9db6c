"""CUDA autocast's op rules on the CPU tracer's fake tensors.

The tracer runs a CUDA target's training step on CPU fake tensors, under CPU autocast. The two autocasts
list different ops: on CUDA, LayerNorm, GroupNorm, RMSNorm, softmax and log_softmax, exp, log, pow, rsqrt,
sums, norms and upsampling run in fp32 (a bf16 input is cast up, or the op accumulates into an fp32 output),
where CPU autocast runs them in the input's dtype. Under bf16 that halves the traced bytes of those ops'
outputs and leaves out the fp32 copies of their inputs: hand-written softmax attention keeps its
probabilities in fp32 on a GPU, and a GroupNorm U-Net its normalized maps (bert-base's MLM head runs its
LayerNorm in fp32 on an H200, in bf16 under CPU autocast). Evidence: bench/estimate_accuracy_cuda.py,
bench/results/accuracy-cuda-h200.json.

`cuda_policy()` applies CUDA's rules, for the ops CUDA's autocast lists and CPU's does not, on the thread
that enters it: a Python kernel at the AutocastCPU dispatch key for each such op (which has none there; the
key falls through for it otherwise), registered once, acting only inside `cuda_policy()` on that thread and
passing the call on unchanged everywhere else. Which ops those are is asked of torch's dispatcher (an
AutocastCUDA kernel and no AutocastCPU one), so a torch that changes its lists changes the set; an op whose
rule is not known here is left as CPU autocast runs it. Ops CPU's autocast lists and CUDA's does not (3-D
pooling, reflection padding, FFTs, linear algebra) keep CPU's rule (tests/advisor/test_autocast_cuda.py
checks the rules against torch's own CUDA autocast, run on fake CUDA tensors).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

# CUDA autocast's rule for each op it lists (aten/src/ATen/autocast_mode.cpp, KERNEL_CUDA): "lower" casts
# floating inputs to the autocast dtype, "fp32" to float32, "fp32_set_opt_dtype" passes dtype=float32 when
# the first tensor is of lower precision and no dtype is given, "promote" casts them to their widest type.
_LOWER = ("_convolution", "convolution", "cudnn_convolution", "cudnn_convolution_transpose", "addmv", "addr", "mv",
          "chain_matmul", "linalg_multi_dot", "einsum", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell",
          "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention")
_FP32 = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log1p", "log2", "reciprocal", "rsqrt",
         "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm", "rms_norm",
         "frobenius_norm", "nuclear_norm", "cosine_similarity", "dist", "pdist", "renorm", "logsumexp", "norm",
         "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
         "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
         "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa")
_SET_OPT_DTYPE = ("softmax", "log_softmax", "cumsum", "cumprod", "sum", "prod", "linalg_vector_norm",
                  "linalg_matrix_norm")
_PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "index_put", "scatter_add",
            "tensordot")
RULES = {**dict.fromkeys(_LOWER, "lower"), **dict.fromkeys(_FP32, "fp32"),
         **dict.fromkeys(_SET_OPT_DTYPE, "fp32_set_opt_dtype"), **dict.fromkeys(_PROMOTE, "promote")}

_state = threading.local()
_lock = threading.Lock()
_library: Any = None  # the torch.library.Library holding the kernels, once registered
_registered: dict[str, str] = {}  # "aten::op.overload" -> its rule


def _eligible(t: Any) -> bool:
    import torch

    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _cast(args: Any, dtype: Any) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(dtype) if _eligible(t) and t.dtype != dtype else t, args)


def _kernel(op: Any, rule: str) -> Any:
    """A Python kernel for `op` at AutocastCPU: `rule` inside `cuda_policy()` on this thread; below
    autocast, unchanged, everywhere else (what the key's fallthrough does)."""
    import torch
    from torch.utils._pytree import tree_flatten

    below = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    dtype_at = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype" and not a.kwarg_only), None)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if getattr(_state, "active", False):
            if rule == "lower":
                args, kwargs = _cast((args, kwargs), torch.get_autocast_dtype("cpu"))
            elif rule == "fp32":
                args, kwargs = _cast((args, kwargs), torch.float32)
            elif rule == "promote":
                floats = [t.dtype for t in tree_flatten((args, kwargs))[0] if _eligible(t)]
                if floats:
                    widest = floats[0]
                    for d in floats[1:]:
                        widest = torch.promote_types(widest, d)
                    args, kwargs = _cast((args, kwargs), widest)
            else:  # fp32_set_opt_dtype
                first = next((t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)), None)
                given = args[dtype_at] if dtype_at is not None and len(args) > dtype_at else kwargs.get("dtype")
                if given is None and _eligible(first) and first.dtype != torch.float32:
                    if dtype_at is not None and len(args) > dtype_at:
                        args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1:])
                    else:
                        kwargs = {**kwargs, "dtype": torch.float32}
        with torch._C._ExcludeDispatchKeyGuard(below):
            return op(*args, **kwargs)

    return kernel


def _register() -> None:
    """Register the kernels once per process: each overload of a RULES op that has an AutocastCUDA kernel
    and no AutocastCPU one (and, for fp32_set_opt_dtype, a dtype argument to set)."""
    global _library
    import torch

    with _lock:
        if _library is not None:
            return
        lib = torch.library.Library("aten", "IMPL")
        for name in torch._C._dispatch_get_all_op_names():
            base = name.removeprefix("aten::").split(".")[0]
            rule = RULES.get(base)
            if (rule is None or not name.startswith("aten::")
                    or not torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCUDA")
                    or torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCPU")):
                continue
            overload = name.split(".", 1)[1] if "." in name else "default"
            op = getattr(getattr(torch.ops.aten, base), overload)
            if rule == "fp32_set_opt_dtype" and not any(a.name == "dtype" for a in op._schema.arguments):
                rule = "fp32"  # CUDA's fp32_append_dtype overloads (norm.Scalar): the fp32 result, as a cast
            lib.impl(name.removeprefix("aten::"), _kernel(op, rule), "AutocastCPU")
            _registered[name] = rule
        _library = lib


@contextlib.contextmanager
def cuda_policy() -> Iterator[None]:
    """CUDA autocast's rules for this thread's CPU autocast regions while inside."""
    _register()
    before = getattr(_state, "active", False)
    _state.active = True
    try:
        yield
    finally:
        _state.active = before


def registered() -> dict[str, str]:
    """The ops given CUDA's rule ("aten::op.overload" -> rule), after the first `cuda_policy()`."""
    return dict(_registered)

"""CUDA's dropout kernels on the CPU tracer's fake tensors.

The tracer runs a CUDA target's training step on CPU fake tensors, so unchanged it would keep what a CPU's
dropout keeps. Two differ on a GPU:
- `F.dropout`: a CPU draws noise in the input's dtype and multiplies by it, keeping the noise for backward
  (4 bytes per element in fp32); CUDA's fused kernel (`native_dropout`) keeps a 1-byte mask.
- `F.scaled_dot_product_attention` with `dropout_p > 0`: a CPU has no fused kernel with dropout and runs the
  math kernel, which keeps the T x T probabilities and their dropout per head; CUDA's flash and
  memory-efficient kernels draw the dropout inside the kernel and keep what they keep without it (the output
  and its logsumexp) and the generator's seed and offset, two scalars.

`cuda_dropout()` runs both as CUDA does, on the thread that enters it: the first as `native_dropout`, the
second as the same call without dropout (the CPU's fused kernel, which keeps what CUDA's do). In-place dropout
is left alone: CUDA runs it as a CPU does.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Iterator

# SDPA's positional parameters, in order (torch.nn.functional.scaled_dot_product_attention)
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


@contextlib.contextmanager
def cuda_dropout() -> Iterator[None]:
    """Dropout as CUDA's kernels keep it (module docstring), inside the block."""
    with _mode_class()():
        yield


@functools.cache
def _mode_class() -> type:
    import torch
    import torch.nn.functional as F

    dropout_sig = inspect.signature(F.dropout)

    class CudaDropout(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.dropout:
                bound = dropout_sig.bind(*args, **kwargs)
                bound.apply_defaults()
                x, p, training, inplace = (bound.arguments[k] for k in ("input", "p", "training", "inplace"))
                if training and 0 < p < 1 and not inplace and x.numel():
                    return torch.native_dropout(x, p, True)[0]
            elif func is F.scaled_dot_product_attention:
                named = dict(zip(_SDPA_PARAMS, args)) | kwargs
                if named.get("dropout_p", 0.0) > 0:
                    return func(**(named | {"dropout_p": 0.0}))
            return func(*args, **kwargs)

    return CudaDropout

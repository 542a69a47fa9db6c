"""A stable identity for a workload's memory behaviour, and the key of a measured configuration.

`workload_fingerprint` hashes what decides a training step's memory: the module tree (class
names by position), parameter and buffer shapes and dtypes, and the batch's per-sample shapes
and dtypes. The model is built on the meta device (nothing allocated, so a 70B model costs
only its Python construction), the batch at sizes 2 and 3 to tell the batch dimension from the
others. Only names, shapes and dtypes enter the hash: no ids, addresses, module paths of
user files (their import names are salted) or values, so it is the same across runs,
processes and machines.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from advisor.errors import SpecError
from advisor.workload import Workload

FINGERPRINT_VERSION = 1  # bump when what enters the hash changes: old points then stop matching
BATCH = "B"  # stands for the batch dimension in a batch signature


def _module_tree(model: Any) -> list[list[str]]:
    """[qualified child name, class name] for every module, in registration order."""
    return [[name, type(m).__qualname__] for name, m in model.named_modules()]


def _tensors(named) -> list[list[Any]]:
    return [[name, list(t.shape), str(t.dtype), bool(getattr(t, "requires_grad", False))] for name, t in named]


def _build_meta(workload: Workload) -> Any:
    """The model without allocating: meta device, else FakeTensorMode (a build that copies real data)."""
    import torch
    from torch.utils._pytree import tree_map

    def on_meta(n: int) -> Any:  # a lazy module's first pass, on the meta model
        return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, workload.make_batch(n))

    try:
        with torch.device("meta"):
            return workload.build(on_meta)
    except Exception:  # noqa: BLE001 - some builds need real storage (e.g. copying a loaded tensor); try fake ones
        from torch._subclasses.fake_tensor import FakeTensorMode

        try:
            with FakeTensorMode(allow_non_fake_inputs=True):
                return workload.build()
        except Exception as exc:
            raise SpecError(f"workload {workload.name}: build_model() failed while fingerprinting: "
                            f"{type(exc).__name__}: {exc}") from exc


def _batch_signature(b2: Any, b3: Any) -> Any:
    """The pytree of batches of 2 and 3 as nested lists/dicts; each tensor as [shape, dtype], the
    dimension that follows the batch size written as 'B'."""
    import torch

    if isinstance(b2, torch.Tensor):
        if not isinstance(b3, torch.Tensor) or b2.dim() != b3.dim():
            raise SpecError("make_batch(2) and make_batch(3) differ in structure; cannot fingerprint the batch")
        shape = [BATCH if x != y else x for x, y in zip(b2.shape, b3.shape)]
        return [shape, str(b2.dtype)]
    if isinstance(b2, dict):
        return {str(k): _batch_signature(b2[k], b3[k]) for k in sorted(b2, key=str)}
    if isinstance(b2, (list, tuple)):
        return [type(b2).__name__] + [_batch_signature(x, y) for x, y in zip(b2, b3)]
    return repr(type(b2).__name__)  # a non-tensor leaf: only its type is stable


def fingerprint_payload(workload: Workload) -> dict[str, Any]:
    """What `workload_fingerprint` hashes, as plain JSON-able data (for debugging a mismatch)."""
    model = _build_meta(workload)
    return {
        "version": FINGERPRINT_VERSION,
        "name": workload.name,
        "modules": _module_tree(model),
        "parameters": _tensors(model.named_parameters()),
        "buffers": _tensors(model.named_buffers()),
        "batch": _batch_signature(workload.make_batch(2), workload.make_batch(3)),
    }


def workload_fingerprint(workload: Workload) -> str:
    """sha256 (32 hex digits) of the workload's module tree, parameter/buffer shapes and dtypes and
    batch signature; equal for the same workload in any process, different when a shape changes."""
    text = json.dumps(fingerprint_payload(workload), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def config_key(fingerprint: str, device: str, knobs: dict[str, Any]) -> str:
    """One string for (workload, device, memory-changing knobs except the batch size)."""
    return "|".join([fingerprint, device] + [f"{k}={knobs[k]}" for k in sorted(knobs)])

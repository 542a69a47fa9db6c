"""The Workload contract (docs/design.md) and loading one from a preset name or `file.py:build`."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field

from advisor.errors import SpecError, WorkloadError


class DecoderArch(BaseModel):
    """Shape of a decoder-only transformer, for the analytic estimator (Korthikanti et al. 2022)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: int = Field(gt=0)
    hidden: int = Field(gt=0, description="Model width d_model.")
    heads: int = Field(gt=0)
    kv_heads: int = Field(gt=0, description="Key/value heads (grouped-query attention); = heads for MHA.")
    ffn_hidden: int = Field(gt=0, description="Width of the feed-forward inner layer.")
    vocab: int = Field(gt=0)
    seq_len: int = Field(gt=0, description="Tokens per sample.")
    gated_ffn: bool = Field(description="SwiGLU (three matrices) instead of a two-matrix MLP.")
    norm: str = Field(description="'layernorm' or 'rmsnorm'.")
    tied_embeddings: bool = False
    learned_positions: bool = Field(default=False, description="GPT-2 style position table (else RoPE).")
    bias: bool = True


class Workload(BaseModel):
    """A model, a way to make a batch of a given size, and a loss: what the advisor trains.

    `make_batch(n)` returns CPU tensors (a tensor, or a tuple/list/dict of tensors);
    `loss_fn(model, batch)` runs forward and returns a scalar loss.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    name: str
    build_model: Callable[[], Any]
    make_batch: Callable[[int], Any]
    loss_fn: Callable[[Any, Any], Any]
    dataset: Callable[[], Any] | None = None
    collate_fn: Callable | None = None
    tokens_per_sample: int | None = Field(default=None, gt=0)
    default_batch_size: int = Field(default=8, gt=0,
                                    description="The batch a user of this workload would start with (samples).")
    decoder: DecoderArch | None = Field(default=None,
                                        description="Set by decoder presets: enables the analytic estimator.")
    embedding_heavy: bool = Field(default=False, description="Embedding tables dominate the parameters (recommenders).")
    conv_net: bool = Field(default=False, description="A convolutional net (channels_last applies).")

    def build(self, batch: Callable[[int], Any] | None = None) -> Any:
        """`build_model()`, with its lazy modules' parameters made (nn.LazyLinear, LazyConv2d, ...: their shapes
        come from the first input) by one forward pass without gradients on a batch of 2 (`make_batch`, or
        `batch`), as torch's documentation tells a user to do before building an optimizer: the advisor builds
        the optimizer, so it makes them. Any other model is returned as built. A pass that fails is a
        WorkloadError naming the workload."""
        model = self.build_model()
        from torch.nn.modules.lazy import LazyModuleMixin

        if not any(isinstance(m, LazyModuleMixin) and m.has_uninitialized_params() for m in model.modules()):
            return model
        import torch

        try:
            with torch.no_grad():
                self.loss_fn(model, (batch or self.make_batch)(2))
        except Exception as exc:  # noqa: BLE001 - the user's forward: any error is theirs, said in one line
            raise WorkloadError(f"workload {self.name}: its lazy modules' parameters could not be made by a forward "
                                f"pass on a batch of 2: {type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
        return model


def parse_workload_args(pairs: list[str] | None, flag: str = "--workload-arg") -> dict[str, Any]:
    """Turn ['k=v', ...] into kwargs; values are parsed as JSON where they parse, else kept as strings."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise SpecError(f"{flag} {pair!r} is not key=value")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def _import_target(target: str) -> Callable[..., Any]:
    module_part, _, attr = target.rpartition(":")
    if module_part.endswith(".py") or "/" in module_part:
        path = Path(module_part)
        if not path.is_file():
            raise WorkloadError(f"workload file {module_part} does not exist")
        mod_name = f"advisor_user_workload_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None or spec.loader is None:
            raise WorkloadError(f"workload file {module_part} cannot be imported as Python")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # user's code: report it in one line
            raise WorkloadError(f"workload file {module_part} failed to import: {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(module_part)
        except Exception as exc:
            raise WorkloadError(f"workload module {module_part} failed to import: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise WorkloadError(f"{module_part} has no callable {attr!r}")
    return fn


def load_workload(spec: str, args: dict[str, Any] | None = None) -> Workload:
    """A preset name (`gpt2-small`), `path/to/file.py:build` or `pkg.module:build` -> Workload."""
    args = args or {}
    if ":" not in spec:
        from advisor.presets import get_preset

        return get_preset(spec)(**args)
    build = _import_target(spec)
    try:
        workload = build(**args)
    except Exception as exc:
        raise WorkloadError(f"{spec}: build() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(workload, Workload):
        raise WorkloadError(f"{spec}: build() returned {type(workload).__name__}, not advisor.Workload")
    return workload

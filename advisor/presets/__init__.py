"""Built-in workloads by name: `PRESETS` (a plain dict) and `get_preset(name)`.

Each entry is a callable taking keyword arguments (batch_size, seq_len, image_size, ...) and
returning an `advisor.Workload`. Entries import their module (and torch) only when called, so
listing the names stays cheap.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

from advisor.errors import SpecError
from advisor.workload import Workload


class _LazyPreset:
    """Calls `advisor.presets.<module>.<function>` on first use; bad keyword arguments raise SpecError."""

    def __init__(self, name: str, module: str, function: str) -> None:
        self.name, self.module, self.function = name, module, function

    def target(self) -> Callable[..., Workload]:
        module = importlib.import_module(f"advisor.presets.{self.module}")
        return getattr(module, self.function)

    @property
    def __signature__(self) -> inspect.Signature:  # so inspect.signature(PRESETS[name]) shows the kwargs
        return inspect.signature(self.target())

    def __call__(self, **kwargs: Any) -> Workload:
        fn = self.target()
        signature = inspect.signature(fn)
        try:
            signature.bind(**kwargs)
        except TypeError as exc:
            accepted = ", ".join(signature.parameters) or "none"
            raise SpecError(f"preset {self.name!r}: {exc}; accepted arguments: {accepted}") from exc
        return fn(**kwargs)

    def __repr__(self) -> str:
        return f"<preset {self.name!r}: advisor.presets.{self.module}.{self.function}>"


# name -> (module, function). Full-size presets first, then the tiny-* ones used by tests.
_ENTRIES: dict[str, tuple[str, str]] = {
    "mlp": ("vision", "mlp"),
    "resnet18": ("vision", "resnet18"),
    "resnet50": ("vision", "resnet50"),
    "vit-b16": ("vision", "vit_b16"),
    "unet": ("vision", "unet"),
    "bert-base": ("transformers", "bert_base"),
    "decoder": ("transformers", "decoder"),  # any decoder-only LM from its arguments (layers, hidden, heads, ...)
    "gpt2-small": ("transformers", "gpt2_small"),
    "gpt2-medium": ("transformers", "gpt2_medium"),
    "gpt2-large": ("transformers", "gpt2_large"),
    "gpt2-xl": ("transformers", "gpt2_xl"),
    "llama-1b": ("transformers", "llama_1b"),
    "llama-8b": ("transformers", "llama_8b"),
    "llama-70b": ("transformers", "llama_70b"),
    "dlrm": ("recsys", "dlrm"),
    "lstm": ("recurrent", "lstm"),
    "tiny-mlp": ("vision", "tiny_mlp"),
    "tiny-resnet": ("vision", "tiny_resnet"),
    "tiny-vit": ("vision", "tiny_vit"),
    "tiny-unet": ("vision", "tiny_unet"),
    "tiny-bert": ("transformers", "tiny_bert"),
    "tiny-decoder": ("transformers", "tiny_decoder"),
    "tiny-gpt2": ("transformers", "tiny_gpt2"),
    "tiny-llama": ("transformers", "tiny_llama"),
    "tiny-dlrm": ("recsys", "tiny_dlrm"),
    "tiny-lstm": ("recurrent", "tiny_lstm"),
    "tiny": ("vision", "tiny_mlp"),  # the registry-wide test entry (STYLE.md): alias of tiny-mlp
}

PRESETS: dict[str, Callable[..., Workload]] = {
    name: _LazyPreset(name, module, function) for name, (module, function) in _ENTRIES.items()
}


def get_preset(name: str) -> Callable[..., Workload]:
    """The preset called `name`; SpecError listing the valid names if there is none."""
    try:
        return PRESETS[name]
    except KeyError:
        raise SpecError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}") from None


__all__ = ["PRESETS", "get_preset"]

"""Small helpers shared by the preset modules: argument checks and the losses they all use."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from advisor.errors import SpecError


def check_positive(preset: str, **values: int | float) -> None:
    """Raise SpecError naming the first preset argument that is not > 0."""
    for key, value in values.items():
        if not value > 0:
            raise SpecError(f"preset {preset!r}: {key} must be > 0, got {value!r}")


def check_divisible(preset: str, what: str, value: int, by: int, by_what: str) -> None:
    """Raise SpecError unless `value` is a multiple of `by` (e.g. hidden by heads)."""
    if value % by:
        raise SpecError(f"preset {preset!r}: {what}={value} must be a multiple of {by_what}={by}")


def generator(seed: int) -> torch.Generator:
    """A CPU generator seeded once, so make_batch and datasets are reproducible."""
    return torch.Generator().manual_seed(seed)


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token (or masked-token) loss. logits (B, T, V), targets (B, T); -100 is ignored.

    Upcast to fp32 so the loss is stable under bf16 autocast, as nanoGPT and torchtitan do.
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)

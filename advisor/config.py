"""The knobs the estimator takes: precision, optimizer, strategy, checkpointing (typed enums shared everywhere)."""

from __future__ import annotations

from enum import Enum


class Precision(str, Enum):
    fp32 = "fp32"
    tf32 = "tf32"
    bf16 = "bf16"  # bf16 autocast, fp32 master weights
    fp16 = "fp16"  # fp16 autocast with a GradScaler
    bf16_pure = "bf16-pure"  # parameters, grads and optimizer state in bf16

    @property
    def autocast_dtype(self):
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.value)


class OptimizerKind(str, Enum):
    sgd = "sgd"
    sgd_momentum = "sgd-momentum"
    adam = "adam"
    adamw = "adamw"
    adagrad = "adagrad"
    rowwise_adagrad = "rowwise-adagrad"


class Strategy(str, Enum):
    single = "single"
    ddp = "ddp"
    zero1 = "zero1"
    zero2 = "zero2"
    zero3 = "zero3"

    @property
    def sharded(self) -> bool:
        return self in (Strategy.zero1, Strategy.zero2, Strategy.zero3)

    @property
    def keeps_gathered(self) -> bool:
        """Whether its FSDP units, once gathered in a step's first forward, stay gathered to its last backward (ZeRO-2:
        advisor/parallel/accumulate.py), where ZeRO-3 gathers them again for each forward and backward."""
        return self is Strategy.zero2


class Checkpointing(str, Enum):
    """Activation checkpointing of the model's repeated blocks (advisor.training.apply_activation_checkpointing).

    Takes the booleans of the knob it replaced (True: full, False: none), and is false only as `none`, so
    `if checkpointing:` reads as it did.
    """

    none = "none"  # every activation backward needs is held
    selective = "selective"  # the attention cores (scaled_dot_product_attention calls) recomputed in backward
    full = "full"  # each repeated block's forward recomputed in backward; only the block inputs are held

    @classmethod
    def _missing_(cls, value: object) -> "Checkpointing | None":
        if value is True:
            return cls.full
        if value is False:
            return cls.none
        return None

    def __bool__(self) -> bool:
        return self is not Checkpointing.none

    @property
    def legacy(self) -> bool | str:
        """What keys of stored results (config hashes, measured peaks) hold for this mode: the booleans of the
        two-mode knob, False (none) and True (full), so those keys still match; the name for selective."""
        return {"none": False, "full": True}.get(self.value, self.value)


CHECKPOINTING_DOC = ("Activation checkpointing of the repeated blocks: none, selective (their attention cores "
                     "recomputed in backward) or full (their forwards recomputed); true means full, false none.")


def choices(enum: type[Enum]) -> str:
    return ", ".join(e.value for e in enum)

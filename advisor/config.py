"""The knobs the estimator takes: precision, optimizer, strategy (typed enums shared everywhere)."""

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


def choices(enum: type[Enum]) -> str:
    return ", ".join(e.value for e in enum)

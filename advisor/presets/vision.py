"""Image and flat-feature presets: mlp, resnet18, resnet50, vit-b16, unet and their tiny-* variants.

Image presets default to ImageNet shapes (224 px, 1000 classes) and read from an ImageDataset
whose items cost `decode_cost_ms` of CPU each, like a JPEG decode + augmentation pipeline.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from advisor.errors import SpecError
from advisor.presets._util import check_divisible, check_positive, generator
from advisor.presets.convnets import BasicBlock, Bottleneck, ResNet, UNet
from advisor.presets.data import ImageDataset, TabularDataset
from advisor.presets.encoders import ViT
from advisor.workload import Workload

DEFAULT_DECODE_COST_MS = 2.0  # per-sample CPU ms: roughly a 224 px JPEG decode + crop/flip on one core


class MLP(nn.Module):
    """`layers` x (Linear + ReLU) on flat features, then a Linear classifier."""

    def __init__(self, in_features: int, hidden: int, layers: int, classes: int) -> None:
        super().__init__()
        widths = [in_features] + [hidden] * layers
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(widths, widths[1:]))
        self.head = nn.Linear(widths[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _classify_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, labels = batch  # a tuple from make_batch, a list from default_collate
    return F.cross_entropy(model(inputs).float(), labels)


def _mlp(name: str, *, batch_size: int, in_features: int, hidden: int, layers: int, classes: int,
         num_samples: int, seed: int) -> Workload:
    check_positive(name, batch_size=batch_size, in_features=in_features, hidden=hidden, layers=layers,
                   classes=classes, num_samples=num_samples)

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = generator(seed)
        return torch.randn(n, in_features, generator=g), torch.randint(0, classes, (n,), generator=g)

    return Workload(
        name=name,
        build_model=lambda: MLP(in_features, hidden, layers, classes),
        make_batch=make_batch,
        loss_fn=_classify_loss,
        dataset=lambda: TabularDataset(num_samples, in_features, classes, seed),
        default_batch_size=batch_size,
    )


def _image(name: str, build: Callable[[], nn.Module], *, image_size: int, classes: int, batch_size: int,
           decode_cost_ms: float, num_samples: int, seed: int, conv_net: bool,
           segmentation: bool = False) -> Workload:
    """A Workload over (B, 3, S, S) images; targets are class ids (B,) or masks (B, S, S)."""
    check_positive(name, image_size=image_size, classes=classes, batch_size=batch_size, num_samples=num_samples)
    if not decode_cost_ms >= 0:
        raise SpecError(f"preset {name!r}: decode_cost_ms must be >= 0, got {decode_cost_ms!r}")

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = generator(seed)
        images = torch.randn(n, 3, image_size, image_size, generator=g)
        shape = (n, image_size, image_size) if segmentation else (n,)
        return images, torch.randint(0, classes, shape, generator=g)

    return Workload(
        name=name,
        build_model=build,
        make_batch=make_batch,
        loss_fn=_classify_loss,  # per-pixel cross entropy for (B, C, S, S) logits vs (B, S, S) masks
        dataset=lambda: ImageDataset(num_samples, image_size, classes, decode_cost_ms, seed, segmentation),
        default_batch_size=batch_size,
        conv_net=conv_net,
    )


def mlp(*, batch_size: int = 256, in_features: int = 784, hidden: int = 2048, layers: int = 3,
        classes: int = 10, num_samples: int = 60_000, seed: int = 0) -> Workload:
    """MNIST-shaped MLP: 784 -> 3 x 2048 -> 10 (~10M params)."""
    return _mlp("mlp", batch_size=batch_size, in_features=in_features, hidden=hidden, layers=layers,
                classes=classes, num_samples=num_samples, seed=seed)


def tiny_mlp(*, batch_size: int = 8, in_features: int = 128, hidden: int = 256, layers: int = 2,
             classes: int = 10, num_samples: int = 256, seed: int = 0) -> Workload:
    """128 -> 2 x 256 -> 10 (~0.1M params), for tests."""
    return _mlp("tiny-mlp", batch_size=batch_size, in_features=in_features, hidden=hidden, layers=layers,
                classes=classes, num_samples=num_samples, seed=seed)


def resnet18(*, batch_size: int = 128, image_size: int = 224, classes: int = 1000,
             decode_cost_ms: float = DEFAULT_DECODE_COST_MS, num_samples: int = 50_000, seed: int = 0) -> Workload:
    """ResNet-18 on ImageNet shapes (11.7M params)."""
    return _image("resnet18", lambda: ResNet(BasicBlock, [2, 2, 2, 2], classes), image_size=image_size,
                  classes=classes, batch_size=batch_size, decode_cost_ms=decode_cost_ms,
                  num_samples=num_samples, seed=seed, conv_net=True)


def resnet50(*, batch_size: int = 64, image_size: int = 224, classes: int = 1000,
             decode_cost_ms: float = DEFAULT_DECODE_COST_MS, num_samples: int = 50_000, seed: int = 0) -> Workload:
    """ResNet-50 (v1.5) on ImageNet shapes (25.6M params)."""
    return _image("resnet50", lambda: ResNet(Bottleneck, [3, 4, 6, 3], classes), image_size=image_size,
                  classes=classes, batch_size=batch_size, decode_cost_ms=decode_cost_ms,
                  num_samples=num_samples, seed=seed, conv_net=True)


def tiny_resnet(*, batch_size: int = 4, image_size: int = 32, classes: int = 10,
                decode_cost_ms: float = 0.5, num_samples: int = 64, seed: int = 0) -> Workload:
    """A one-block-per-stage, 16-wide ResNet on 32 px images (~0.3M params)."""
    return _image("tiny-resnet", lambda: ResNet(BasicBlock, [1, 1, 1, 1], classes, base_width=16),
                  image_size=image_size, classes=classes, batch_size=batch_size, decode_cost_ms=decode_cost_ms,
                  num_samples=num_samples, seed=seed, conv_net=True)


def _vit(name: str, *, image_size: int, patch: int, layers: int, hidden: int, heads: int, classes: int,
         batch_size: int, decode_cost_ms: float, num_samples: int, seed: int) -> Workload:
    check_positive(name, patch=patch, layers=layers, hidden=hidden, heads=heads)
    check_divisible(name, "image_size", image_size, patch, "patch")
    check_divisible(name, "hidden", hidden, heads, "heads")
    return _image(name, lambda: ViT(image_size, patch, layers, hidden, heads, classes), image_size=image_size,
                  classes=classes, batch_size=batch_size, decode_cost_ms=decode_cost_ms,
                  num_samples=num_samples, seed=seed, conv_net=False)  # one patchify conv; the rest is attention


def vit_b16(*, batch_size: int = 64, image_size: int = 224, classes: int = 1000,
            decode_cost_ms: float = DEFAULT_DECODE_COST_MS, num_samples: int = 50_000, seed: int = 0) -> Workload:
    """ViT-B/16: 12 layers, 768 wide, 12 heads, 16 px patches (86.6M params)."""
    return _vit("vit-b16", image_size=image_size, patch=16, layers=12, hidden=768, heads=12, classes=classes,
                batch_size=batch_size, decode_cost_ms=decode_cost_ms, num_samples=num_samples, seed=seed)


def tiny_vit(*, batch_size: int = 4, image_size: int = 32, classes: int = 10,
             decode_cost_ms: float = 0.5, num_samples: int = 64, seed: int = 0) -> Workload:
    """A 2-layer, 128-wide ViT on 32 px images with 8 px patches (~0.4M params)."""
    return _vit("tiny-vit", image_size=image_size, patch=8, layers=2, hidden=128, heads=4, classes=classes,
                batch_size=batch_size, decode_cost_ms=decode_cost_ms, num_samples=num_samples, seed=seed)


def _unet(name: str, *, image_size: int, base: int, depth: int, classes: int, batch_size: int,
          decode_cost_ms: float, num_samples: int, seed: int) -> Workload:
    check_positive(name, base=base, depth=depth)
    check_divisible(name, "image_size", image_size, 2**depth, "2**depth")
    return _image(name, lambda: UNet(classes, base, depth), image_size=image_size, classes=classes,
                  batch_size=batch_size, decode_cost_ms=decode_cost_ms, num_samples=num_samples, seed=seed,
                  conv_net=True, segmentation=True)


def unet(*, batch_size: int = 16, image_size: int = 256, classes: int = 21, base: int = 32, depth: int = 4,
         decode_cost_ms: float = DEFAULT_DECODE_COST_MS, num_samples: int = 10_000, seed: int = 0) -> Workload:
    """UNet segmentation (Pascal VOC's 21 classes), 32 -> 512 channels over 4 levels (~7.8M params)."""
    return _unet("unet", image_size=image_size, base=base, depth=depth, classes=classes, batch_size=batch_size,
                 decode_cost_ms=decode_cost_ms, num_samples=num_samples, seed=seed)


def tiny_unet(*, batch_size: int = 2, image_size: int = 32, classes: int = 4, base: int = 16, depth: int = 2,
              decode_cost_ms: float = 0.5, num_samples: int = 64, seed: int = 0) -> Workload:
    """A 2-level, 16-wide UNet on 32 px images (~0.1M params)."""
    return _unet("tiny-unet", image_size=image_size, base=base, depth=depth, classes=classes,
                 batch_size=batch_size, decode_cost_ms=decode_cost_ms, num_samples=num_samples, seed=seed)

"""Convolutional nets for the image presets: ResNet (He et al. 2015) and a small UNet.

ResNet keeps its residual blocks in one flat `self.blocks` ModuleList (the repeated unit the
estimator and checkpointing wrappers look for); UNet keeps its encoder and decoder stages in
ModuleLists. Images are (B, 3, S, S) float.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, kernel, stride, padding=kernel // 2, bias=False), nn.BatchNorm2d(cout)]


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    # 1x1 projection where the shape changes (torchvision's "option B"), identity otherwise.
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(*_conv_bn(cin, cout, 1, stride))


class BasicBlock(nn.Module):
    """Two 3x3 convs (ResNet-18/34). Output channels = width."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*_conv_bn(cin, width, 3, stride), nn.ReLU(inplace=True), *_conv_bn(width, width, 3))
        self.shortcut = _shortcut(cin, width, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (stride here, as in torchvision's ResNet v1.5), 1x1 expand x4 (ResNet-50+)."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.body = nn.Sequential(
            *_conv_bn(cin, width, 1), nn.ReLU(inplace=True),
            *_conv_bn(width, width, 3, stride), nn.ReLU(inplace=True),
            *_conv_bn(width, cout, 1),
        )
        self.shortcut = _shortcut(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


class ResNet(nn.Module):
    """ImageNet ResNet: 7x7/2 stem + maxpool, four stages (stride 1, 2, 2, 2), global pool, fc."""

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], depths: list[int], classes: int,
                 base_width: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(*_conv_bn(3, base_width, 7, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        blocks: list[nn.Module] = []
        cin = base_width
        for stage, depth in enumerate(depths):
            width = base_width * 2**stage  # 64, 128, 256, 512 for the real nets
            for i in range(depth):
                blocks.append(block(cin, width, stride=2 if stage > 0 and i == 0 else 1))
                cin = width * block.expansion
        self.blocks = nn.ModuleList(blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for block in self.blocks:
            x = block(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        *_conv_bn(cin, cout, 3), nn.ReLU(inplace=True), *_conv_bn(cout, cout, 3), nn.ReLU(inplace=True)
    )


class UNet(nn.Module):
    """UNet (Ronneberger et al. 2015) with BatchNorm and 'same' padding, so output size = input size.

    `depth` downsamplings by 2 (image_size must be a multiple of 2**depth); channels double per
    level from `base`. forward(images (B, 3, S, S)) -> per-pixel logits (B, classes, S, S).
    """

    def __init__(self, classes: int, base: int = 32, depth: int = 4) -> None:
        super().__init__()
        widths = [base * 2**i for i in range(depth + 1)]  # e.g. 32, 64, 128, 256, 512 (bottleneck)
        self.down = nn.ModuleList(_double_conv(cin, cout) for cin, cout in zip([3] + widths[:-2], widths[:-1]))
        self.bottleneck = _double_conv(widths[-2], widths[-1])
        self.upsample = nn.ModuleList(nn.ConvTranspose2d(w * 2, w, 2, stride=2) for w in reversed(widths[:-1]))
        # Each decoder stage sees the upsampled map concatenated with the encoder skip: 2w -> w.
        self.up = nn.ModuleList(_double_conv(w * 2, w) for w in reversed(widths[:-1]))
        self.head = nn.Conv2d(base, classes, 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        skips = []
        x = images
        for stage in self.down:
            x = stage(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.bottleneck(x)
        for upsample, stage, skip in zip(self.upsample, self.up, reversed(skips)):
            x = stage(torch.cat((upsample(x), skip), dim=1))
        return self.head(x)

"""Workloads written before any estimate of them was looked at, against the public Workload contract only
(docs/design.md; `bench/estimate_accuracy.py --set fresh8`): a triplet network (one encoder run three times a step,
on anchors, positives and negatives, and a triplet margin loss); a super-resolution net (EDSR-style residual blocks
at low resolution, then PixelShuffle up 4x, an L1 loss at full resolution); a RealNVP normalizing flow (affine
coupling layers under checkerboard and channel masks, squeezes, a log-determinant summed through the flow, a
negative log-likelihood); a hypernetwork (a small net that generates each sample's own weights for the main net,
applied with bmm, so the weights the main net uses are activations of the batch's size). Not to be tuned against: a
change of the estimator made for these cases calls for another set.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from advisor import Workload


def _gen(seed=0):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


# ---------------------------------------------------------------------------------------------------------
# Triplet network: one shared encoder, three passes a step


class _Encoder(nn.Module):
    def __init__(self, width, dim):
        super().__init__()
        layers, c = [], 3
        for out in (width, width * 2, width * 4, width * 8):
            layers += [nn.Conv2d(c, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(),
                       nn.Conv2d(out, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(), nn.MaxPool2d(2)]
            c = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c, dim)

    def forward(self, x):
        return F.normalize(self.head(self.features(x).mean(dim=(2, 3))), dim=1)


def triplet(batch_size: int = 32, image: int = 64, width: int = 32, dim: int = 128, margin: float = 0.2):
    def make_batch(n):
        g = _gen()
        return tuple(torch.randn(n, 3, image, image, generator=g) for _ in range(3))

    def loss_fn(model, batch):
        anchor, positive, negative = (model(x) for x in batch)
        return F.triplet_margin_loss(anchor, positive, negative, margin=margin)

    return Workload(name="triplet", build_model=lambda: _Encoder(width, dim), make_batch=make_batch,
                    loss_fn=loss_fn, default_batch_size=batch_size)


# ---------------------------------------------------------------------------------------------------------
# Super-resolution: residual blocks at low resolution, PixelShuffle up


class _ResBlock(nn.Module):
    def __init__(self, c, scale):
        super().__init__()
        self.conv1, self.conv2, self.scale = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1), scale

    def forward(self, x):
        return x + self.scale * self.conv2(F.relu(self.conv1(x)))


class _SuperRes(nn.Module):
    def __init__(self, width, blocks, factor):
        super().__init__()
        self.head = nn.Conv2d(3, width, 3, padding=1)
        self.body = nn.Sequential(*[_ResBlock(width, 0.1) for _ in range(blocks)],
                                  nn.Conv2d(width, width, 3, padding=1))
        ups = []
        for _ in range(int(math.log2(factor))):
            ups += [nn.Conv2d(width, width * 4, 3, padding=1), nn.PixelShuffle(2)]
        self.up = nn.Sequential(*ups, nn.Conv2d(width, 3, 3, padding=1))

    def forward(self, x):
        h = self.head(x)
        return self.up(h + self.body(h))


def superres(batch_size: int = 16, patch: int = 32, width: int = 64, blocks: int = 8, factor: int = 4):
    def make_batch(n):
        g = _gen()
        high = torch.rand(n, 3, patch * factor, patch * factor, generator=g)
        return F.avg_pool2d(high, factor), high

    def loss_fn(model, batch):
        low, high = batch
        return F.l1_loss(model(low), high)

    return Workload(name="superres", build_model=lambda: _SuperRes(width, blocks, factor), make_batch=make_batch,
                    loss_fn=loss_fn, default_batch_size=batch_size)


# ---------------------------------------------------------------------------------------------------------
# RealNVP: affine couplings under masks, squeezes, the log-determinant summed through the flow


class _Coupling(nn.Module):
    def __init__(self, c, hidden, mask):
        super().__init__()
        self.register_buffer("mask", mask)
        self.net = nn.Sequential(nn.Conv2d(c, hidden, 3, padding=1), nn.ReLU(), nn.Conv2d(hidden, hidden, 1), nn.ReLU(),
                                 nn.Conv2d(hidden, 2 * c, 3, padding=1))
        self.scale = nn.Parameter(torch.zeros(1, c, 1, 1))

    def forward(self, x, logdet):
        kept = x * self.mask
        s, t = self.net(kept).chunk(2, dim=1)
        s = self.scale * torch.tanh(s) * (1 - self.mask)
        y = kept + (1 - self.mask) * (x * torch.exp(s) + t)
        return y, logdet + s.flatten(1).sum(1)


def _checker(c, size, flip):
    m = ((torch.arange(size)[:, None] + torch.arange(size)[None, :]) % 2).float()
    return (1 - m if flip else m).expand(1, c, size, size).clone()


def _channels(c, size, flip):
    m = torch.zeros(1, c, size, size)
    m[:, : c // 2] = 1
    return 1 - m if flip else m


class _RealNVP(nn.Module):
    def __init__(self, image, hidden, scales):
        super().__init__()
        self.stages = nn.ModuleList()
        c, size = 3, image
        for _ in range(scales):
            layers = [_Coupling(c, hidden, _checker(c, size, i % 2 == 1)) for i in range(3)]
            c, size = c * 4, size // 2
            layers += [_Coupling(c, hidden, _channels(c, size, i % 2 == 1)) for i in range(3)]
            self.stages.append(nn.ModuleList(layers))

    def forward(self, x):
        logdet = torch.zeros(x.shape[0], device=x.device)
        for layers in self.stages:
            for i, layer in enumerate(layers):
                if i == 3:  # squeeze: 2 x 2 spatial blocks into channels
                    x = F.pixel_unshuffle(x, 2)
                x, logdet = layer(x, logdet)
        log_prior = -0.5 * (x ** 2 + math.log(2 * math.pi)).flatten(1).sum(1)
        return -(log_prior + logdet).mean() / x[0].numel()


def realnvp(batch_size: int = 16, image: int = 64, hidden: int = 64, scales: int = 2):
    def make_batch(n):
        g = _gen()
        return torch.rand(n, 3, image, image, generator=g) - 0.5 + torch.rand(n, 3, image, image, generator=g) / 256

    return Workload(name="realnvp", build_model=lambda: _RealNVP(image, hidden, scales), make_batch=make_batch,
                    loss_fn=lambda model, x: model(x), default_batch_size=batch_size)


# ---------------------------------------------------------------------------------------------------------
# Hypernetwork: each sample's main-net weights generated from its own context, applied with bmm


class _HyperNet(nn.Module):
    def __init__(self, features, context, hidden, width, classes):
        super().__init__()
        self.features, self.width = features, width
        self.embed = nn.Sequential(nn.Linear(context, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU())
        self.w1 = nn.Linear(hidden, features * width)
        self.b1 = nn.Linear(hidden, width)
        self.w2 = nn.Linear(hidden, width * width)
        self.head = nn.Linear(width, classes)

    def forward(self, x, ctx):
        n = x.shape[0]
        z = self.embed(ctx)
        w1 = self.w1(z).view(n, self.features, self.width) / math.sqrt(self.features)
        w2 = self.w2(z).view(n, self.width, self.width) / math.sqrt(self.width)
        h = F.gelu(torch.bmm(x, w1) + self.b1(z).unsqueeze(1))  # x: (n, points, features)
        h = F.gelu(torch.bmm(h, w2))
        return self.head(h.mean(dim=1))


def hypernet(batch_size: int = 64, points: int = 256, features: int = 64, context: int = 32, hidden: int = 256,
             width: int = 128, classes: int = 10):
    def make_batch(n):
        g = _gen()
        return (torch.randn(n, points, features, generator=g), torch.randn(n, context, generator=g),
                torch.randint(0, classes, (n,), generator=g))

    def loss_fn(model, batch):
        x, ctx, y = batch
        return F.cross_entropy(model(x, ctx), y)

    return Workload(name="hypernet", build_model=lambda: _HyperNet(features, context, hidden, width, classes),
                    make_batch=make_batch, loss_fn=loss_fn, default_batch_size=batch_size)

"""Workloads written before any estimate of them was looked at, against the public Workload contract only
(docs/design.md; `bench/estimate_accuracy.py --set fresh3`): a DenseNet (every layer concatenates all earlier
feature maps, the memory-hungry way a plain implementation does), a Swin-style transformer (shifted-window
attention: torch.roll, windows cut out by view/permute copies, a relative position bias gathered through an index
buffer, patch merging by strided slices), a NeRF-style MLP (rays x samples points, sin/cos positional encoding, a
skip connection, volume rendering with exp and an exclusive cumprod) and a CTC speech model (1-D convolutions under
weight_norm's parametrization, a pre-norm torch TransformerEncoder, log-softmax, F.ctc_loss over targets of varying
length). Not to be tuned against: a change of the estimator made for these cases calls for another set.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from advisor import Workload


def _gen(seed=0):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _images(image_size, classes):
    """make_batch for the image classifiers: n RGB images and their labels."""
    def make_batch(n):
        g = _gen()
        return torch.randn(n, 3, image_size, image_size, generator=g), torch.randint(0, classes, (n,), generator=g)

    return make_batch


# ---------------------------------------------------------------------------------------------------------
# DenseNet-BC


class _DenseLayer(nn.Module):
    def __init__(self, cin, growth, bn_size):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, bn_size * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)

    def forward(self, features):
        x = torch.cat(features, 1)
        x = self.conv1(F.relu(self.norm1(x)))
        return self.conv2(F.relu(self.norm2(x)))


class _DenseBlock(nn.Module):
    def __init__(self, layers, cin, growth, bn_size):
        super().__init__()
        self.layers = nn.ModuleList(_DenseLayer(cin + i * growth, growth, bn_size) for i in range(layers))

    def forward(self, x):
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return torch.cat(features, 1)


def densenet(batch_size: int = 16, image_size: int = 64, growth: int = 32, blocks: tuple = (6, 12, 24, 16),
             bn_size: int = 4, classes: int = 100):
    def build_model():
        ch = 2 * growth
        layers = [nn.Conv2d(3, ch, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(ch), nn.ReLU(inplace=True),
                  nn.MaxPool2d(3, stride=2, padding=1)]
        for i, n in enumerate(blocks):
            layers.append(_DenseBlock(n, ch, growth, bn_size))
            ch += n * growth
            if i < len(blocks) - 1:
                layers += [nn.BatchNorm2d(ch), nn.ReLU(inplace=True), nn.Conv2d(ch, ch // 2, 1, bias=False),
                           nn.AvgPool2d(2)]
                ch //= 2
        layers += [nn.BatchNorm2d(ch), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                   nn.Linear(ch, classes)]
        return nn.Sequential(*layers)

    def loss_fn(model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    return Workload(name="densenet", build_model=build_model, make_batch=_images(image_size, classes), loss_fn=loss_fn,
                    default_batch_size=batch_size, conv_net=True)


# ---------------------------------------------------------------------------------------------------------
# Swin-style shifted-window transformer


class _WindowAttention(nn.Module):
    def __init__(self, dim, heads, window):
        super().__init__()
        self.heads, self.window = heads, window
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.bias_table = nn.Parameter(torch.zeros((2 * window - 1) ** 2, heads))
        nn.init.trunc_normal_(self.bias_table, std=0.02)
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.register_buffer("rel_index", rel[..., 0] * (2 * window - 1) + rel[..., 1], persistent=False)

    def forward(self, x, mask):  # x: windows*B, window*window, C; mask: windows, N, N or None
        bw, n, c = x.shape
        q, k, v = self.qkv(x).reshape(bw, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q * (c // self.heads) ** -0.5) @ k.transpose(-2, -1)
        attn = attn + self.bias_table[self.rel_index.reshape(-1)].reshape(n, n, -1).permute(2, 0, 1)
        if mask is not None:
            nw = mask.shape[0]
            attn = attn.view(bw // nw, nw, self.heads, n, n) + mask[None, :, None]
            attn = attn.view(bw, self.heads, n, n)
        out = (attn.softmax(-1) @ v).transpose(1, 2).reshape(bw, n, c)
        return self.proj(out)


class _SwinBlock(nn.Module):
    def __init__(self, dim, heads, window, shift, res):
        super().__init__()
        self.window, self.shift, self.res = window, shift, res
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = _WindowAttention(dim, heads, window)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        if shift:
            img = torch.zeros(res, res)
            cnt = 0
            for hs in (slice(0, -window), slice(-window, -shift), slice(-shift, None)):
                for ws in (slice(0, -window), slice(-window, -shift), slice(-shift, None)):
                    img[hs, ws] = cnt
                    cnt += 1
            win = self._partition(img[None, :, :, None]).squeeze(-1)  # windows, N
            mask = (win[:, None, :] != win[:, :, None]).float() * -100.0
            self.register_buffer("mask", mask, persistent=False)
        else:
            self.mask = None

    def _partition(self, x):  # B, H, W, C -> B*windows, window*window, C
        b, h, w, c = x.shape
        s = self.window
        return x.view(b, h // s, s, w // s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, s * s, c)

    def forward(self, x):  # B, H*W, C
        b, n, c = x.shape
        h = w = self.res
        y = self.norm1(x).view(b, h, w, c)
        if self.shift:
            y = torch.roll(y, shifts=(-self.shift, -self.shift), dims=(1, 2))
        y = self.attn(self._partition(y), self.mask)
        s = self.window
        y = y.view(b, h // s, w // s, s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
        if self.shift:
            y = torch.roll(y, shifts=(self.shift, self.shift), dims=(1, 2))
        x = x + y.reshape(b, n, c)
        return x + self.mlp(self.norm2(x))


class _PatchMerging(nn.Module):
    def __init__(self, dim, res):
        super().__init__()
        self.res = res
        self.norm = nn.LayerNorm(4 * dim)
        self.reduce = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x):
        b, _, c = x.shape
        x = x.view(b, self.res, self.res, c)
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
        return self.reduce(self.norm(x.reshape(b, -1, 4 * c)))


class _Swin(nn.Module):
    def __init__(self, image_size, patch, dim, depths, heads, window, classes):
        super().__init__()
        self.embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.embed_norm = nn.LayerNorm(dim)
        res = image_size // patch
        stages = []
        for i, (d, h) in enumerate(zip(depths, heads)):
            if i:
                stages.append(_PatchMerging(dim, res))
                dim, res = dim * 2, res // 2
            w = min(window, res)
            stages += [_SwinBlock(dim, h, w, (w // 2) if j % 2 and res > w else 0, res) for j in range(d)]
        self.stages = nn.Sequential(*stages)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.embed_norm(self.embed(x).flatten(2).transpose(1, 2))
        return self.head(self.norm(self.stages(x)).mean(1))


def swin(batch_size: int = 16, image_size: int = 128, patch: int = 4, dim: int = 96, depths: tuple = (2, 2, 6, 2),
         heads: tuple = (3, 6, 12, 24), window: int = 8, classes: int = 100):
    def loss_fn(model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y, label_smoothing=0.1)

    return Workload(name="swin", build_model=lambda: _Swin(image_size, patch, dim, depths, heads, window, classes),
                    make_batch=_images(image_size, classes), loss_fn=loss_fn, default_batch_size=batch_size)


# ---------------------------------------------------------------------------------------------------------
# NeRF-style radiance field


def _encode(x, freqs):
    bands = (2.0 ** torch.arange(freqs, dtype=x.dtype, device=x.device)) * math.pi
    xb = (x[..., None] * bands).flatten(-2)
    return torch.cat([x, torch.sin(xb), torch.cos(xb)], -1)


class _NeRF(nn.Module):
    def __init__(self, width, depth, skip, pos_freqs, dir_freqs):
        super().__init__()
        self.pos_freqs, self.dir_freqs, self.skip = pos_freqs, dir_freqs, skip
        pos_dim, dir_dim = 3 + 6 * pos_freqs, 3 + 6 * dir_freqs
        self.layers = nn.ModuleList(nn.Linear(pos_dim if i == 0 else width + (pos_dim if i == skip else 0), width)
                                    for i in range(depth))
        self.sigma = nn.Linear(width, 1)
        self.feature = nn.Linear(width, width)
        self.rgb = nn.Sequential(nn.Linear(width + dir_dim, width // 2), nn.ReLU(), nn.Linear(width // 2, 3))

    def forward(self, origins, dirs, near, far, samples):  # origins, dirs: rays, 3
        t = torch.linspace(0.0, 1.0, samples, device=origins.device)
        z = near + (far - near) * t  # samples
        pts = origins[:, None, :] + dirs[:, None, :] * z[None, :, None]  # rays, samples, 3
        enc = _encode(pts, self.pos_freqs)
        h = enc
        for i, layer in enumerate(self.layers):
            if i == self.skip:
                h = torch.cat([h, enc], -1)
            h = F.relu(layer(h))
        sigma = F.softplus(self.sigma(h)).squeeze(-1)
        d = _encode(dirs / dirs.norm(dim=-1, keepdim=True), self.dir_freqs)[:, None, :].expand(-1, samples, -1)
        rgb = torch.sigmoid(self.rgb(torch.cat([self.feature(h), d], -1)))
        delta = torch.cat([z[1:] - z[:-1], z.new_full((1,), 1e10)])
        alpha = 1.0 - torch.exp(-sigma * delta)
        trans = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1.0 - alpha + 1e-10], -1), -1)[:, :-1]
        weights = alpha * trans
        return (weights[..., None] * rgb).sum(1)


def nerf(batch_size: int = 1024, samples: int = 64, width: int = 256, depth: int = 8, pos_freqs: int = 10,
         dir_freqs: int = 4):
    def make_batch(n):
        g = _gen()
        origins = torch.randn(n, 3, generator=g) * 0.1
        dirs = torch.randn(n, 3, generator=g)
        return origins, dirs, torch.rand(n, 3, generator=g)

    def loss_fn(model, batch):
        origins, dirs, target = batch
        return F.mse_loss(model(origins, dirs, 2.0, 6.0, samples), target)

    return Workload(name="nerf", build_model=lambda: _NeRF(width, depth, depth // 2, pos_freqs, dir_freqs),
                    make_batch=make_batch, loss_fn=loss_fn, default_batch_size=batch_size)


# ---------------------------------------------------------------------------------------------------------
# CTC speech recognizer


class _CtcModel(nn.Module):
    def __init__(self, mels, d, heads, layers, vocab):
        super().__init__()
        self.sub = nn.Sequential(weight_norm(nn.Conv1d(mels, d, 3, stride=2, padding=1)), nn.GELU(),
                                 weight_norm(nn.Conv1d(d, d, 3, stride=2, padding=1)), nn.GELU())
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.out = nn.Linear(d, vocab)

    def forward(self, feats):  # N, mels, frames
        x = self.sub(feats).transpose(1, 2)  # N, frames / 4, d
        return self.out(self.encoder(x)).log_softmax(-1)


def ctc(batch_size: int = 16, mels: int = 80, frames: int = 800, d: int = 256, heads: int = 4, layers: int = 6,
        vocab: int = 32, max_target: int = 80):
    def make_batch(n):
        g = _gen()
        feats = torch.randn(n, mels, frames, generator=g)
        target_lengths = torch.randint(max_target // 2, max_target + 1, (n,), generator=g)
        targets = torch.randint(1, vocab, (n, max_target), generator=g)
        return feats, targets, target_lengths

    def loss_fn(model, batch):
        feats, targets, target_lengths = batch
        log_probs = model(feats).transpose(0, 1)  # T, N, vocab
        input_lengths = torch.full((feats.shape[0],), log_probs.shape[0], dtype=torch.long)
        return F.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=True)

    return Workload(name="ctc", build_model=lambda: _CtcModel(mels, d, heads, layers, vocab), make_batch=make_batch,
                    loss_fn=loss_fn, default_batch_size=batch_size)

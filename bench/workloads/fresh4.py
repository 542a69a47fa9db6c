"""Workloads written before any estimate of them was looked at, against the public Workload contract only
(docs/design.md; `bench/estimate_accuracy.py --set fresh4`): a Perceiver-style model (a learned latent array
cross-attending to a long input through F.scaled_dot_product_attention, then self-attention on the latents, GEGLU
feed-forwards), a WaveNet-style autoregressive audio model (dilated causal 1-D convolutions, gated tanh x sigmoid
units, residual and skip sums, a 256-way softmax at every time step), a spatial-transformer classifier (a
localisation net predicts an affine warp, applied with F.affine_grid and F.grid_sample, then a CNN with BatchNorm
and dropout) and a bidirectional LSTM tagger over packed sequences of varying length (pack_padded_sequence with
unsorted lengths, pad_packed_sequence, a cross-entropy that ignores the padding). Not to be tuned against: a change
of the estimator made for these cases calls for another set.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from advisor import Workload


def _gen(seed=0):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


# ---------------------------------------------------------------------------------------------------------
# Perceiver


class _GEGLU(nn.Module):
    def __init__(self, d, mult=4):
        super().__init__()
        self.proj = nn.Linear(d, 2 * mult * d)
        self.out = nn.Linear(mult * d, d)

    def forward(self, x):
        a, gate = self.proj(x).chunk(2, dim=-1)
        return self.out(a * F.gelu(gate))


class _Attention(nn.Module):
    """Multi-head attention of queries x over context c (c = x: self-attention), through SDPA."""

    def __init__(self, d, heads, d_ctx=None, dropout=0.0):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.q = nn.Linear(d, d, bias=False)
        self.kv = nn.Linear(d_ctx or d, 2 * d, bias=False)
        self.o = nn.Linear(d, d)

    def forward(self, x, c):
        n, lq, d = x.shape
        h = self.heads
        q = self.q(x).view(n, lq, h, d // h).transpose(1, 2)
        k, v = self.kv(c).view(n, c.shape[1], 2, h, d // h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.o(y.transpose(1, 2).reshape(n, lq, d))


class _Perceiver(nn.Module):
    def __init__(self, in_dim, freqs, latents, d, heads, self_layers, classes):
        super().__init__()
        ctx = in_dim + 2 * freqs + 1
        self.freqs = freqs
        self.latents = nn.Parameter(torch.randn(latents, d) * 0.02)
        self.ctx_norm = nn.LayerNorm(ctx)
        self.cross_norm = nn.LayerNorm(d)
        self.cross = _Attention(d, 1, d_ctx=ctx)
        self.cross_ff = nn.Sequential(nn.LayerNorm(d), _GEGLU(d))
        self.blocks = nn.ModuleList(
            nn.ModuleList([nn.LayerNorm(d), _Attention(d, heads, dropout=0.1), nn.LayerNorm(d), _GEGLU(d)])
            for _ in range(self_layers))
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, classes))

    def _positions(self, n, m, device, dtype):
        pos = torch.linspace(-1.0, 1.0, m, device=device, dtype=dtype)[:, None]
        bands = torch.linspace(1.0, m / 2, self.freqs, device=device, dtype=dtype) * math.pi
        enc = torch.cat([pos, torch.sin(pos * bands), torch.cos(pos * bands)], -1)
        return enc.expand(n, -1, -1)

    def forward(self, x):  # N, M, in_dim
        n, m, _ = x.shape
        c = self.ctx_norm(torch.cat([x, self._positions(n, m, x.device, x.dtype)], -1))
        z = self.latents.expand(n, -1, -1)
        z = z + self.cross(self.cross_norm(z), c)
        z = z + self.cross_ff(z)
        for n1, attn, n2, ff in self.blocks:
            y = n1(z)
            z = z + attn(y, y)
            z = z + ff(n2(z))
        return self.head(z.mean(1))


def perceiver(batch_size: int = 16, inputs: int = 4096, in_dim: int = 32, freqs: int = 32, latents: int = 256,
              d: int = 512, heads: int = 8, self_layers: int = 6, classes: int = 100):
    def make_batch(n):
        g = _gen()
        return torch.randn(n, inputs, in_dim, generator=g), torch.randint(0, classes, (n,), generator=g)

    def loss_fn(model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y, label_smoothing=0.1)

    return Workload(name="perceiver",
                    build_model=lambda: _Perceiver(in_dim, freqs, latents, d, heads, self_layers, classes),
                    make_batch=make_batch, loss_fn=loss_fn, default_batch_size=batch_size)


# ---------------------------------------------------------------------------------------------------------
# WaveNet


class _GatedLayer(nn.Module):
    def __init__(self, res, skip, dilation):
        super().__init__()
        self.dilation = dilation
        self.conv = nn.Conv1d(res, 2 * res, 2, dilation=dilation)
        self.res = nn.Conv1d(res, res, 1)
        self.skip = nn.Conv1d(res, skip, 1)

    def forward(self, x):
        y = self.conv(F.pad(x, (self.dilation, 0)))  # causal: the output at t sees t and t - dilation
        filt, gate = y.chunk(2, dim=1)
        z = torch.tanh(filt) * torch.sigmoid(gate)
        return x + self.res(z), self.skip(z)


class _WaveNet(nn.Module):
    def __init__(self, classes, res, skip, layers, stacks):
        super().__init__()
        self.embed = nn.Embedding(classes, res)
        self.layers = nn.ModuleList(_GatedLayer(res, skip, 2 ** i) for _ in range(stacks) for i in range(layers))
        self.out = nn.Sequential(nn.ReLU(), nn.Conv1d(skip, skip, 1), nn.ReLU(), nn.Conv1d(skip, classes, 1))

    def forward(self, tokens):  # N, T
        x = self.embed(tokens).transpose(1, 2)  # N, res, T
        skips = 0
        for layer in self.layers:
            x, s = layer(x)
            skips = skips + s
        return self.out(skips)  # N, classes, T


def wavenet(batch_size: int = 4, samples: int = 4096, classes: int = 256, res: int = 64, skip: int = 128,
            layers: int = 10, stacks: int = 2):
    def make_batch(n):
        g = _gen()
        t = torch.arange(samples + 1, dtype=torch.float32)
        wave = torch.sin(t[None] * torch.rand(n, 1, generator=g) * 0.2) + 0.1 * torch.randn(n, samples + 1, generator=g)
        mu = classes - 1  # mu-law companding to `classes` levels
        q = torch.sign(wave) * torch.log1p(mu * wave.abs().clamp(max=1.0)) / math.log1p(mu)
        return ((q + 1) / 2 * mu).round().long()

    def loss_fn(model, tokens):
        return F.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])

    return Workload(name="wavenet", build_model=lambda: _WaveNet(classes, res, skip, layers, stacks),
                    make_batch=make_batch, loss_fn=loss_fn, default_batch_size=batch_size)


# ---------------------------------------------------------------------------------------------------------
# Spatial transformer classifier


class _STN(nn.Module):
    def __init__(self, size, width, classes):
        super().__init__()
        self.size = size
        self.loc = nn.Sequential(nn.Conv2d(3, 32, 7, padding=3), nn.MaxPool2d(2), nn.ReLU(),
                                 nn.Conv2d(32, 64, 5, padding=2), nn.MaxPool2d(2), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(64 * 16, 128), nn.ReLU(),
                                 nn.Linear(128, 6))
        nn.init.zeros_(self.loc[-1].weight)
        with torch.no_grad():
            self.loc[-1].bias.copy_(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0]))

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                                 nn.MaxPool2d(2))

        self.features = nn.Sequential(block(3, width), block(width, 2 * width), block(2 * width, 4 * width),
                                      block(4 * width, 8 * width))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.3), nn.Linear(8 * width * (size // 16) ** 2, classes))

    def forward(self, x):
        theta = self.loc(x).view(-1, 2, 3)
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        warped = F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
        return self.head(self.features(warped))


def stn(batch_size: int = 32, image_size: int = 96, width: int = 48, classes: int = 43):
    def make_batch(n):
        g = _gen()
        return torch.randn(n, 3, image_size, image_size, generator=g), torch.randint(0, classes, (n,), generator=g)

    def loss_fn(model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    return Workload(name="stn", build_model=lambda: _STN(image_size, width, classes), make_batch=make_batch,
                    loss_fn=loss_fn, default_batch_size=batch_size)


# ---------------------------------------------------------------------------------------------------------
# Bidirectional LSTM tagger over packed sequences


class _Tagger(nn.Module):
    def __init__(self, vocab, dim, hidden, layers, tags):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.drop = nn.Dropout(0.2)
        self.lstm = nn.LSTM(dim, hidden, layers, batch_first=True, bidirectional=True, dropout=0.2)
        self.out = nn.Linear(2 * hidden, tags)

    def forward(self, tokens, lengths):  # N, T and N lengths (on the CPU, as pack_padded_sequence wants)
        packed = pack_padded_sequence(self.drop(self.embed(tokens)), lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=tokens.shape[1])
        return self.out(self.drop(out))  # N, T, tags


def tagger(batch_size: int = 32, max_len: int = 200, vocab: int = 30000, dim: int = 256, hidden: int = 384,
           layers: int = 2, tags: int = 48):
    def make_batch(n):
        g = _gen()
        lengths = torch.randint(max_len // 4, max_len + 1, (n,), generator=g)
        lengths[0] = max_len  # the longest sets the padded length, as a bucketed loader's batch would
        tokens = torch.randint(1, vocab, (n, max_len), generator=g)
        labels = torch.randint(0, tags, (n, max_len), generator=g)
        pad = torch.arange(max_len)[None] >= lengths[:, None]
        return tokens.masked_fill(pad, 0), labels.masked_fill(pad, -100), lengths

    def loss_fn(model, batch):
        tokens, labels, lengths = batch
        logits = model(tokens, lengths.cpu())
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    return Workload(name="tagger", build_model=lambda: _Tagger(vocab, dim, hidden, layers, tags),
                    make_batch=make_batch, loss_fn=loss_fn, default_batch_size=batch_size)

"""Workloads written before any estimate of them was looked at, against the public Workload contract only
(docs/design.md; `bench/estimate_accuracy.py --set fresh6`): two with batches that read their own values or graphs
that depend on the data, a DCN-v2 recommender over multi-hot features of random length (EmbeddingBag with offsets:
make_batch sums random lengths to size its index tensor) and a universal transformer with adaptive computation time
(one shared block applied until every token halts: the step count is read from the data); two without, a selective
state-space model (Mamba-style selective scan, a Python loop over time, in pure PyTorch) and a VQ-VAE (codebook
distances, argmin, a straight-through estimator, transposed convolutions). Not to be tuned against: a change of the
estimator made for these cases calls for another set.
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
# DCN-v2 recommender over multi-hot features


class _Cross(nn.Module):
    """One DCN-v2 cross layer: x0 * (W x + b) + x."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x0, x):
        return x0 * self.lin(x) + x


class _DCN(nn.Module):
    def __init__(self, dense, features, rows, dim, crosses, deep):
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="mean") for _ in range(features))
        d = dense + features * dim
        self.crosses = nn.ModuleList(_Cross(d) for _ in range(crosses))
        layers, width = [], d
        for w in deep:
            layers += [nn.Linear(width, w), nn.ReLU()]
            width = w
        self.deep = nn.Sequential(*layers)
        self.out = nn.Linear(d + width, 1)

    def forward(self, dense, indices, offsets):
        # indices[f], offsets[f]: one flat index tensor and its bag offsets per feature
        x0 = torch.cat([dense] + [bag(i, o) for bag, i, o in zip(self.bags, indices, offsets)], 1)
        x = x0
        for c in self.crosses:
            x = c(x0, x)
        return self.out(torch.cat([x, self.deep(x0)], 1)).squeeze(1)


def dcn(batch_size: int = 1024, dense: int = 13, features: int = 8, rows: int = 100_000, dim: int = 64,
        crosses: int = 3, max_hot: int = 20):
    def make_batch(n):
        g = _gen()
        indices, offsets = [], []
        for _ in range(features):
            # each sample's bag holds 1..max_hot ids: the flat index tensor's length is read from the lengths
            lengths = torch.randint(1, max_hot + 1, (n,), generator=g)
            indices.append(torch.randint(0, rows, (int(lengths.sum()),), generator=g))
            offsets.append(torch.cumsum(lengths, 0) - lengths)
        return torch.randn(n, dense, generator=g), indices, offsets, (torch.rand(n, generator=g) < 0.25).float()

    def loss_fn(model, batch):
        x, indices, offsets, clicked = batch
        return F.binary_cross_entropy_with_logits(model(x, indices, offsets), clicked)

    return Workload(name="dcn", build_model=lambda: _DCN(dense, features, rows, dim, crosses, (1024, 512, 256)),
                    make_batch=make_batch, loss_fn=loss_fn, default_batch_size=batch_size)


# ---------------------------------------------------------------------------------------------------------
# Universal transformer with adaptive computation time


class _SharedBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.step_emb = nn.Embedding(16, d)

    def forward(self, x, step):
        n, t, d = x.shape
        x = x + self.step_emb.weight[step]
        q, k, v = self.qkv(self.n1(x)).view(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(n, t, d))
        return x + self.ff(self.n2(x))


class _ACT(nn.Module):
    """Graves' adaptive computation time over a shared block, per token (as in the Universal Transformer)."""

    def __init__(self, vocab, d, heads, seq, max_steps, classes):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, seq, d) * 0.02)
        self.block = _SharedBlock(d, heads)
        self.halt = nn.Linear(d, 1)
        nn.init.constant_(self.halt.bias, 0.25)  # start by halting after a few steps: 5-7 of 12 at seed 0
        self.max_steps = max_steps
        self.head = nn.Linear(d, classes)

    def forward(self, tokens):
        x = self.emb(tokens) + self.pos
        n, t, _ = x.shape
        halted = torch.zeros(n, t, device=x.device)
        remainders = torch.zeros(n, t, device=x.device)
        out = torch.zeros_like(x)
        step = 0
        # run the block while any token of the batch is still computing: how many times is read from the data
        while step < self.max_steps and bool((halted < 0.99).any()):
            p = torch.sigmoid(self.halt(x)).squeeze(-1)
            running = (halted < 0.99).to(x.dtype)
            new_halted = halted + p * running
            stopping = (new_halted >= 0.99).to(x.dtype) * running
            weight = p * running * (1 - stopping) + (1 - halted) * stopping
            remainders = remainders + (1 - halted) * stopping
            halted = new_halted
            x = self.block(x, step)
            out = out + weight[..., None] * x
            step += 1
        return self.head(out.mean(1)), remainders.mean()


def act(batch_size: int = 8, vocab: int = 16000, d: int = 384, heads: int = 6, seq: int = 128, max_steps: int = 12,
        classes: int = 20):
    def make_batch(n):
        g = _gen()
        return torch.randint(0, vocab, (n, seq), generator=g), torch.randint(0, classes, (n,), generator=g)

    def loss_fn(model, batch):
        tokens, y = batch
        logits, ponder = model(tokens)
        return F.cross_entropy(logits, y) + 0.01 * ponder

    return Workload(name="act", build_model=lambda: _ACT(vocab, d, heads, seq, max_steps, classes),
                    make_batch=make_batch, loss_fn=loss_fn, default_batch_size=batch_size)


# ---------------------------------------------------------------------------------------------------------
# Selective state-space model (Mamba-style, pure PyTorch scan)


class _Mixer(nn.Module):
    def __init__(self, d, state, expand, conv):
        super().__init__()
        inner = expand * d
        self.norm = nn.LayerNorm(d)
        self.inp = nn.Linear(d, 2 * inner)
        self.conv = nn.Conv1d(inner, inner, conv, padding=conv - 1, groups=inner)
        self.dt_rank = math.ceil(d / 16)
        self.x_proj = nn.Linear(inner, self.dt_rank + 2 * state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, inner)
        self.a_log = nn.Parameter(torch.log(torch.arange(1, state + 1, dtype=torch.float32)).repeat(inner, 1))
        self.d_skip = nn.Parameter(torch.ones(inner))
        self.out = nn.Linear(inner, d)
        self.state = state

    def forward(self, x):  # N, L, d
        n, length, _ = x.shape
        u, z = self.inp(self.norm(x)).chunk(2, -1)
        u = F.silu(self.conv(u.transpose(1, 2))[..., :length].transpose(1, 2))
        dt, b, c = self.x_proj(u).split([self.dt_rank, self.state, self.state], -1)
        dt = F.softplus(self.dt_proj(dt))  # N, L, inner
        a = -torch.exp(self.a_log)  # inner, state
        da = torch.exp(dt[..., None] * a)  # N, L, inner, state
        dbu = dt[..., None] * b[:, :, None, :] * u[..., None]
        h = x.new_zeros(n, a.shape[0], self.state)
        ys = []
        for da_t, dbu_t, c_t in zip(da.unbind(1), dbu.unbind(1), c.unbind(1)):  # the selective scan, step by step
            h = da_t * h + dbu_t
            ys.append((h * c_t[:, None, :]).sum(-1))
        y = torch.stack(ys, 1) + u * self.d_skip
        return x + self.out(y * F.silu(z))


class _SSM(nn.Module):
    def __init__(self, vocab, d, layers, state, expand, conv):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.Sequential(*(_Mixer(d, state, expand, conv) for _ in range(layers)))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        nn.init.normal_(self.emb.weight, std=0.02)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(self.norm(self.layers(self.emb(tokens))))


def ssm(batch_size: int = 8, vocab: int = 8000, d: int = 256, layers: int = 4, state: int = 16, expand: int = 2,
        conv: int = 4, seq: int = 128):
    def make_batch(n):
        g = _gen()
        tokens = torch.randint(0, vocab, (n, seq + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    def loss_fn(model, batch):
        x, y = batch
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    return Workload(name="ssm", build_model=lambda: _SSM(vocab, d, layers, state, expand, conv),
                    make_batch=make_batch, loss_fn=loss_fn, default_batch_size=batch_size)


# ---------------------------------------------------------------------------------------------------------
# VQ-VAE


class _Res(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.body = nn.Sequential(nn.ReLU(), nn.Conv2d(c, c // 2, 3, padding=1), nn.ReLU(), nn.Conv2d(c // 2, c, 1))

    def forward(self, x):
        return x + self.body(x)


class _VQVAE(nn.Module):
    def __init__(self, width, codes, code_dim, beta):
        super().__init__()
        w = width
        self.enc = nn.Sequential(nn.Conv2d(3, w, 4, 2, 1), nn.ReLU(), nn.Conv2d(w, 2 * w, 4, 2, 1), _Res(2 * w),
                                 _Res(2 * w), nn.Conv2d(2 * w, code_dim, 1))
        self.codebook = nn.Embedding(codes, code_dim)
        nn.init.uniform_(self.codebook.weight, -1.0 / codes, 1.0 / codes)
        self.dec = nn.Sequential(nn.Conv2d(code_dim, 2 * w, 3, padding=1), _Res(2 * w), _Res(2 * w),
                                 nn.ConvTranspose2d(2 * w, w, 4, 2, 1), nn.ReLU(), nn.ConvTranspose2d(w, 3, 4, 2, 1))
        self.beta = beta

    def forward(self, img):
        z = self.enc(img)  # N, D, H, W
        n, dim, h, w = z.shape
        flat = z.permute(0, 2, 3, 1).reshape(-1, dim)
        codes = torch.cdist(flat, self.codebook.weight).argmin(1)
        q = self.codebook(codes).view(n, h, w, dim).permute(0, 3, 1, 2)
        vq_loss = F.mse_loss(q, z.detach()) + self.beta * F.mse_loss(z, q.detach())
        recon = self.dec(z + (q - z).detach())  # straight-through
        return recon, vq_loss


def vqvae(batch_size: int = 16, image: int = 128, width: int = 128, codes: int = 1024, code_dim: int = 64,
          beta: float = 0.25):
    def make_batch(n):
        return torch.rand(n, 3, image, image, generator=_gen())

    def loss_fn(model, batch):
        recon, vq_loss = model(batch)
        return F.mse_loss(recon, batch) + vq_loss

    return Workload(name="vqvae", build_model=lambda: _VQVAE(width, codes, code_dim, beta),
                    make_batch=make_batch, loss_fn=loss_fn, default_batch_size=batch_size)

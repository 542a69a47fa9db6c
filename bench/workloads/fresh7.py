"""Workloads written before any estimate of them was looked at, against the public Workload contract only
(docs/design.md; `bench/estimate_accuracy.py --set fresh7`): a WGAN-GP step (a generator and a critic, the critic's
gradient penalty taken with torch.autograd.grad(create_graph=True), so the backward runs through a graph built by a
backward); a Fourier neural operator (complex-valued parameters, rfft2/irfft2, an einsum over the kept modes); MoCo
v2 (a momentum key encoder, a deep copy of the query encoder updated in place in forward and never by the optimizer,
and a queue of 16384 negative keys kept as a buffer and written in place each step); a capsule network (dynamic
routing by agreement, three iterations over a large prediction tensor, a masked reconstruction decoder). Not to be
tuned against: a change of the estimator made for these cases calls for another set.
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn

from advisor import Workload


def _gen(seed=0):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


# ---------------------------------------------------------------------------------------------------------
# WGAN-GP: generator and critic in one step, the critic's gradient penalty by double backward


class _GAN(nn.Module):
    def __init__(self, z, width, image):
        super().__init__()
        self.z, self.width, self.start = z, width, image // 16
        self.fc = nn.Linear(z, width * 8 * self.start * self.start)
        ups, c = [], width * 8
        for _ in range(4):
            ups += [nn.ConvTranspose2d(c, c // 2, 4, stride=2, padding=1), nn.GroupNorm(8, c // 2), nn.ReLU()]
            c //= 2
        self.gen = nn.Sequential(*ups, nn.Conv2d(c, 3, 3, padding=1), nn.Tanh())
        downs, c = [nn.Conv2d(3, width // 2, 3, padding=1), nn.LeakyReLU(0.2)], width // 2
        for _ in range(4):  # no batch norm in a WGAN-GP critic: the penalty is per sample
            downs += [nn.Conv2d(c, c * 2, 4, stride=2, padding=1), nn.LeakyReLU(0.2)]
            c *= 2
        self.critic = nn.Sequential(*downs, nn.Flatten(), nn.Linear(c * self.start * self.start, 1))

    def generate(self, noise):
        return self.gen(self.fc(noise).view(noise.shape[0], self.width * 8, self.start, self.start))


def wgangp(batch_size: int = 16, z: int = 128, width: int = 64, image: int = 64, penalty: float = 10.0):
    def make_batch(n):
        g = _gen()
        return torch.rand(n, 3, image, image, generator=g) * 2 - 1, torch.randn(n, z, generator=g), \
            torch.rand(n, 1, 1, 1, generator=g)

    def loss_fn(model, batch):
        real, noise, mix = batch
        fake = model.generate(noise)
        critic_loss = model.critic(fake.detach()).mean() - model.critic(real).mean()
        between = (mix * real + (1 - mix) * fake.detach()).requires_grad_(True)
        grad, = torch.autograd.grad(model.critic(between).sum(), between, create_graph=True)
        gp = ((grad.flatten(1).norm(dim=1) - 1) ** 2).mean()
        gen_loss = -model.critic(fake).mean()
        return critic_loss + penalty * gp + gen_loss

    return Workload(name="wgangp", build_model=lambda: _GAN(z, width, image), make_batch=make_batch,
                    loss_fn=loss_fn, default_batch_size=batch_size)


# ---------------------------------------------------------------------------------------------------------
# Fourier neural operator (2-D), complex weights


class _Spectral(nn.Module):
    def __init__(self, cin, cout, modes):
        super().__init__()
        self.modes = modes
        scale = 1 / (cin * cout)
        self.w1 = nn.Parameter(scale * torch.randn(cin, cout, modes, modes, dtype=torch.cfloat))
        self.w2 = nn.Parameter(scale * torch.randn(cin, cout, modes, modes, dtype=torch.cfloat))

    def forward(self, x):
        n, _, h, w = x.shape
        m = self.modes
        xf = torch.fft.rfft2(x.float())  # CPU FFTs take no bf16: autocast's bf16 activations come back to fp32
        out = torch.zeros(n, self.w1.shape[1], h, w // 2 + 1, dtype=torch.cfloat, device=x.device)
        out[:, :, :m, :m] = torch.einsum("bixy,ioxy->boxy", xf[:, :, :m, :m], self.w1)
        out[:, :, -m:, :m] = torch.einsum("bixy,ioxy->boxy", xf[:, :, -m:, :m], self.w2)
        return torch.fft.irfft2(out, s=(h, w))


class _FNO(nn.Module):
    def __init__(self, cin, width, modes, layers):
        super().__init__()
        self.lift = nn.Conv2d(cin + 2, width, 1)
        self.spectral = nn.ModuleList(_Spectral(width, width, modes) for _ in range(layers))
        self.pointwise = nn.ModuleList(nn.Conv2d(width, width, 1) for _ in range(layers))
        self.proj = nn.Sequential(nn.Conv2d(width, 128, 1), nn.GELU(), nn.Conv2d(128, 1, 1))

    def forward(self, a):
        n, _, h, w = a.shape
        ys, xs = torch.meshgrid(torch.linspace(0, 1, h, device=a.device), torch.linspace(0, 1, w, device=a.device),
                                indexing="ij")
        x = self.lift(torch.cat([a, ys.expand(n, 1, h, w), xs.expand(n, 1, h, w)], 1))
        for i, (spec, point) in enumerate(zip(self.spectral, self.pointwise)):
            x = spec(x) + point(x)
            if i < len(self.spectral) - 1:
                x = F.gelu(x)
        return self.proj(x)


def fno(batch_size: int = 8, grid: int = 128, width: int = 48, modes: int = 16, layers: int = 4):
    def make_batch(n):
        g = _gen()
        a = torch.randn(n, 1, grid, grid, generator=g)
        return a, torch.cumsum(a, dim=-1) / grid  # a smooth target: the solution of a toy operator

    def loss_fn(model, batch):
        a, u = batch
        return F.mse_loss(model(a).float(), u)

    return Workload(name="fno", build_model=lambda: _FNO(1, width, modes, layers), make_batch=make_batch,
                    loss_fn=loss_fn, default_batch_size=batch_size)


# ---------------------------------------------------------------------------------------------------------
# MoCo v2: momentum key encoder and a queue of negatives


def _encoder(width, dim):
    def stage(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                             nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

    return nn.Sequential(stage(3, width), stage(width, width * 2), stage(width * 2, width * 4),
                         stage(width * 4, width * 8), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(width * 8, 512), nn.ReLU(), nn.Linear(512, dim))


class _MoCo(nn.Module):
    def __init__(self, width, dim, queue, momentum, temperature):
        super().__init__()
        self.query = _encoder(width, dim)
        self.key = copy.deepcopy(self.query)
        for p in self.key.parameters():
            p.requires_grad_(False)
        self.register_buffer("queue", F.normalize(torch.randn(dim, queue), dim=0))
        self.ptr, self.m, self.t = 0, momentum, temperature

    def forward(self, view1, view2):
        q = F.normalize(self.query(view1), dim=1)
        with torch.no_grad():
            for pk, pq in zip(self.key.parameters(), self.query.parameters()):
                pk.mul_(self.m).add_(pq.detach(), alpha=1 - self.m)
            k = F.normalize(self.key(view2), dim=1)
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ self.queue.clone().detach()], 1) / self.t
        n, size = k.shape[0], self.queue.shape[1]
        with torch.no_grad():
            idx = (torch.arange(n, device=k.device) + self.ptr) % size
            self.queue[:, idx] = k.T.to(self.queue.dtype)  # bf16 keys under autocast, an fp32 queue
        self.ptr = (self.ptr + n) % size
        return logits


def moco(batch_size: int = 32, image: int = 96, width: int = 48, dim: int = 128, queue: int = 16384,
         momentum: float = 0.999, temperature: float = 0.2):
    def make_batch(n):
        g = _gen()
        x = torch.rand(n, 3, image, image, generator=g)
        return x, torch.flip(x, dims=(3,)) + 0.05 * torch.randn(n, 3, image, image, generator=g)

    def loss_fn(model, batch):
        logits = model(*batch)
        return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device))

    return Workload(name="moco", build_model=lambda: _MoCo(width, dim, queue, momentum, temperature),
                    make_batch=make_batch, loss_fn=loss_fn, default_batch_size=batch_size)


# ---------------------------------------------------------------------------------------------------------
# Capsule network with dynamic routing


def _squash(s, dim=-1):
    n2 = (s * s).sum(dim, keepdim=True)
    return n2 / (1 + n2) * s / torch.sqrt(n2 + 1e-8)


class _CapsNet(nn.Module):
    def __init__(self, image, classes, iterations):
        super().__init__()
        self.conv = nn.Conv2d(1, 256, 9)
        self.primary = nn.Conv2d(256, 32 * 8, 9, stride=2)
        side = ((image - 8) - 9) // 2 + 1
        self.caps = 32 * side * side
        self.W = nn.Parameter(0.01 * torch.randn(1, self.caps, classes, 16, 8))
        self.iterations, self.classes = iterations, classes
        self.decoder = nn.Sequential(nn.Linear(16 * classes, 512), nn.ReLU(), nn.Linear(512, 1024), nn.ReLU(),
                                     nn.Linear(1024, image * image), nn.Sigmoid())

    def forward(self, x, y):
        n = x.shape[0]
        h = F.relu(self.conv(x))
        u = self.primary(h).view(n, 32, 8, -1).permute(0, 1, 3, 2).reshape(n, self.caps, 8)
        u = _squash(u)
        u_hat = (self.W @ u[:, :, None, :, None]).squeeze(-1)  # n, caps, classes, 16
        logits = torch.zeros(n, self.caps, self.classes, device=x.device, dtype=u_hat.dtype)
        detached = u_hat.detach()
        for i in range(self.iterations):
            c = logits.softmax(dim=2)
            last = i == self.iterations - 1
            v = _squash((c[..., None] * (u_hat if last else detached)).sum(1))  # n, classes, 16
            if not last:
                logits = logits + (detached * v[:, None]).sum(-1)
        lengths = v.norm(dim=-1)
        mask = F.one_hot(y, self.classes).to(v.dtype)
        recon = self.decoder((v * mask[..., None]).flatten(1))
        return lengths, recon


def capsnet(batch_size: int = 32, image: int = 28, classes: int = 10, iterations: int = 3):
    def make_batch(n):
        g = _gen()
        return torch.rand(n, 1, image, image, generator=g), torch.randint(0, classes, (n,), generator=g)

    def loss_fn(model, batch):
        x, y = batch
        lengths, recon = model(x, y)
        t = F.one_hot(y, lengths.shape[1]).to(lengths.dtype)
        margin = (t * F.relu(0.9 - lengths) ** 2 + 0.5 * (1 - t) * F.relu(lengths - 0.1) ** 2).sum(1).mean()
        return margin + 0.0005 * F.mse_loss(recon.float(), x.flatten(1), reduction="sum") / x.shape[0]

    return Workload(name="capsnet", build_model=lambda: _CapsNet(image, classes, iterations),
                    make_batch=make_batch, loss_fn=loss_fn, default_batch_size=batch_size)

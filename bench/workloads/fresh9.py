"""Workloads written before any estimate of them was looked at, against the public Workload contract only
(docs/design.md; `bench/estimate_accuracy.py --set fresh9`): a neural ODE (one convolutional dynamics block
integrated by a fixed-step Runge-Kutta 4 solver, so one block's weights serve sixteen evaluations whose activations
all stay for the backward); a sliding-window attention language model (keys and values padded and cut into windows
with Tensor.unfold, strided views that the einsums copy); a squeeze-and-excitation ResNet with stochastic depth
(per-sample Bernoulli masks on the residual branches) trained on mixup batches (a random permutation and a
Beta-drawn mix, a soft-target cross-entropy); knowledge distillation (a frozen teacher, without gradients, run under
torch.no_grad inside the step beside the student it teaches, a temperature-scaled KL divergence). Not to be tuned
against: a change of the estimator made for these cases calls for another set.
"""

import torch
import torch.nn.functional as F
from torch import nn

from advisor import Workload


def _gen(seed=0):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _labelled_images(image, classes):
    """make_batch for the image models here: n RGB images of image x image and a class label each."""

    def make_batch(n):
        g = _gen()
        return torch.randn(n, 3, image, image, generator=g), torch.randint(0, classes, (n,), generator=g)

    return make_batch


# ---------------------------------------------------------------------------------------------------------
# Neural ODE: one dynamics block, integrated by RK4 over fixed steps


class _Dynamics(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.net = nn.Sequential(nn.GroupNorm(8, c), nn.SiLU(), nn.Conv2d(c, c, 3, padding=1),
                                 nn.GroupNorm(8, c), nn.SiLU(), nn.Conv2d(c, c, 3, padding=1))

    def forward(self, h):
        return self.net(h)


class _NeuralODE(nn.Module):
    def __init__(self, c, steps, classes):
        super().__init__()
        self.steps = steps
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, stride=2, padding=1), nn.SiLU())
        self.f = _Dynamics(c)
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        h, dt = self.stem(x), 1.0 / self.steps
        for _ in range(self.steps):
            k1 = self.f(h)
            k2 = self.f(h + 0.5 * dt * k1)
            k3 = self.f(h + 0.5 * dt * k2)
            k4 = self.f(h + dt * k3)
            h = h + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        return self.head(h.mean(dim=(2, 3)))


def node(batch_size: int = 16, image: int = 64, channels: int = 64, steps: int = 4, classes: int = 10):
    def loss_fn(model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    return Workload(name="node", build_model=lambda: _NeuralODE(channels, steps, classes),
                    make_batch=_labelled_images(image, classes), loss_fn=loss_fn, default_batch_size=batch_size,
                    conv_net=True)


# ---------------------------------------------------------------------------------------------------------
# Sliding-window attention: each token attends to the `window` tokens either side, via unfold


class _LocalAttention(nn.Module):
    def __init__(self, dim, heads, window):
        super().__init__()
        self.heads, self.window = heads, window
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        h, w = self.heads, self.window
        q, k, v = self.qkv(x).view(b, t, 3, h, d // h).unbind(dim=2)  # each (b, t, h, dh)
        # pad the time axis by w both sides, then cut each position's 2w+1 window: (b, t, h, dh, 2w+1) views
        kw = F.pad(k, (0, 0, 0, 0, w, w)).unfold(1, 2 * w + 1, 1)
        vw = F.pad(v, (0, 0, 0, 0, w, w)).unfold(1, 2 * w + 1, 1)
        scores = torch.einsum("bthd,bthdw->bthw", q, kw) / (d // h) ** 0.5
        pos = torch.arange(t, device=x.device).unsqueeze(1) + torch.arange(-w, w + 1, device=x.device)
        valid = (pos >= 0) & (pos < t)  # the padding's positions take no weight
        scores = scores.masked_fill(~valid[None, :, None, :], float("-inf"))
        attn = scores.softmax(dim=-1)
        return self.out(torch.einsum("bthw,bthdw->bthd", attn, vw).reshape(b, t, d))


class _LocalBlock(nn.Module):
    def __init__(self, dim, heads, window):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = _LocalAttention(dim, heads, window)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class _LocalLM(nn.Module):
    def __init__(self, vocab, dim, heads, window, layers):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_LocalBlock(dim, heads, window) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def localattn(batch_size: int = 4, seq_len: int = 1024, vocab: int = 4096, dim: int = 256, heads: int = 4,
              window: int = 16, layers: int = 4):
    def make_batch(n):
        return torch.randint(0, vocab, (n, seq_len + 1), generator=_gen())

    def loss_fn(model, tokens):
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))

    return Workload(name="localattn", build_model=lambda: _LocalLM(vocab, dim, heads, window, layers),
                    make_batch=make_batch, loss_fn=loss_fn, default_batch_size=batch_size, tokens_per_sample=seq_len)


# ---------------------------------------------------------------------------------------------------------
# SE-ResNet with stochastic depth, on mixup batches


class _SEBlock(nn.Module):
    def __init__(self, c_in, c_out, stride, drop, reduction=4):
        super().__init__()
        self.drop = drop
        self.body = nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
                                  nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out))
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c_out, c_out // reduction, 1), nn.ReLU(),
                                nn.Conv2d(c_out // reduction, c_out, 1), nn.Sigmoid())
        self.skip = nn.Identity() if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        y = self.body(x)
        y = y * self.se(y)
        if self.training and self.drop > 0:  # stochastic depth: drop the branch per sample, rescale the kept
            keep = torch.rand(y.shape[0], 1, 1, 1, device=y.device) >= self.drop
            y = y * keep / (1 - self.drop)
        return F.relu(self.skip(x) + y)


class _SEResNet(nn.Module):
    def __init__(self, width, classes, drop):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        plan = [(width, width, 1), (width, width, 1), (width, 2 * width, 2), (2 * width, 2 * width, 1),
                (2 * width, 4 * width, 2), (4 * width, 4 * width, 1), (4 * width, 8 * width, 2),
                (8 * width, 8 * width, 1)]
        self.blocks = nn.Sequential(*(_SEBlock(i, o, s, drop * (k + 1) / len(plan))
                                      for k, (i, o, s) in enumerate(plan)))
        self.head = nn.Linear(8 * width, classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def seresnet(batch_size: int = 32, image: int = 64, width: int = 32, classes: int = 100, drop: float = 0.2,
             alpha: float = 0.4):
    def loss_fn(model, batch):
        x, y = batch
        lam = float(torch.distributions.Beta(alpha, alpha).sample())
        perm = torch.randperm(x.shape[0], device=x.device)
        mixed = lam * x + (1 - lam) * x[perm]
        target = lam * F.one_hot(y, classes).float() + (1 - lam) * F.one_hot(y[perm], classes).float()
        return torch.sum(-target * F.log_softmax(model(mixed), dim=-1), dim=-1).mean()

    return Workload(name="seresnet", build_model=lambda: _SEResNet(width, classes, drop),
                    make_batch=_labelled_images(image, classes), loss_fn=loss_fn, default_batch_size=batch_size,
                    conv_net=True)


# ---------------------------------------------------------------------------------------------------------
# Knowledge distillation: a frozen teacher beside the student it teaches


def _convnet(widths, classes):
    layers, c = [], 3
    for out in widths:
        layers += [nn.Conv2d(c, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(),
                   nn.Conv2d(out, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(), nn.MaxPool2d(2)]
        c = out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes))


class _Distill(nn.Module):
    def __init__(self, classes):
        super().__init__()
        self.teacher = _convnet((64, 128, 256, 512), classes)
        self.teacher.requires_grad_(False)
        self.student = _convnet((32, 64, 128), classes)

    def train(self, mode=True):
        super().train(mode)
        self.teacher.eval()  # a teacher keeps its running statistics
        return self

    def forward(self, x):
        with torch.no_grad():
            teacher = self.teacher(x)
        return self.student(x), teacher


def distill(batch_size: int = 32, image: int = 64, classes: int = 100, temperature: float = 4.0, mix: float = 0.7):
    def loss_fn(model, batch):
        x, y = batch
        student, teacher = model(x)
        soft = F.kl_div(F.log_softmax(student / temperature, dim=-1), F.log_softmax(teacher / temperature, dim=-1),
                        reduction="batchmean", log_target=True) * temperature ** 2
        return mix * soft + (1 - mix) * F.cross_entropy(student, y)

    return Workload(name="distill", build_model=lambda: _Distill(classes), make_batch=_labelled_images(image, classes),
                    loss_fn=loss_fn, default_batch_size=batch_size, conv_net=True)

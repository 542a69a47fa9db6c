"""Workloads written before any estimate of them was looked at, against the public Workload contract only
(docs/design.md; `bench/estimate_accuracy.py --set fresh2`): a ConvNeXt-style CNN (7x7 depthwise convolutions,
LayerNorm over channels-last permutes, layer scale), a PointNet (point clouds: shared per-point MLPs as 1-D
convolutions, a learned 3x3 and 64x64 transform applied by bmm, max pooling over points), a SimCLR-style contrastive
model (two views of each image through one encoder, an NT-Xent loss over a 2B x 2B similarity matrix) and an
FT-Transformer for tabular data (a dict batch of numeric and categorical columns, one token per column, a CLS token,
pre-norm encoder layers). Not to be tuned against: a change of the estimator made for these cases calls for another
set.
"""

import torch
import torch.nn.functional as F
from torch import nn

from advisor import Workload


def _gen(seed=0):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


class _ConvNeXtBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pw1 = nn.Linear(dim, 4 * dim)
        self.pw2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(1e-6 * torch.ones(dim))

    def forward(self, x):
        y = self.dw(x).permute(0, 2, 3, 1)  # N, H, W, C
        y = self.pw2(F.gelu(self.pw1(self.norm(y))))
        return x + (self.gamma * y).permute(0, 3, 1, 2)


class _ChannelNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, x):
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def convnext(batch_size: int = 16, image_size: int = 96, dims: tuple = (64, 128, 256, 512),
             depths: tuple = (2, 2, 6, 2), classes: int = 200):
    def build_model():
        layers = [nn.Conv2d(3, dims[0], 4, stride=4), _ChannelNorm(dims[0])]
        for i, (d, n) in enumerate(zip(dims, depths)):
            if i:
                layers += [_ChannelNorm(dims[i - 1]), nn.Conv2d(dims[i - 1], d, 2, stride=2)]
            layers += [_ConvNeXtBlock(d) for _ in range(n)]
        return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.LayerNorm(dims[-1]),
                             nn.Linear(dims[-1], classes))

    def make_batch(n):
        g = _gen()
        return torch.randn(n, 3, image_size, image_size, generator=g), torch.randint(0, classes, (n,), generator=g)

    def loss_fn(model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y, label_smoothing=0.1)

    return Workload(name="convnext", build_model=build_model, make_batch=make_batch, loss_fn=loss_fn,
                    default_batch_size=batch_size, conv_net=True)


class _TNet(nn.Module):
    """Predicts a k x k transform of the points' features (identity-initialised offset)."""

    def __init__(self, k):
        super().__init__()
        self.k = k
        self.feat = nn.Sequential(nn.Conv1d(k, 64, 1), nn.BatchNorm1d(64), nn.ReLU(),
                                  nn.Conv1d(64, 128, 1), nn.BatchNorm1d(128), nn.ReLU(),
                                  nn.Conv1d(128, 1024, 1), nn.BatchNorm1d(1024), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(1024, 512), nn.BatchNorm1d(512), nn.ReLU(),
                                  nn.Linear(512, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, k * k))

    def forward(self, x):  # x: N, k, points
        m = self.head(self.feat(x).amax(dim=2))
        return m.view(-1, self.k, self.k) + torch.eye(self.k, device=x.device, dtype=m.dtype)


class _PointNet(nn.Module):
    def __init__(self, classes):
        super().__init__()
        self.t3, self.t64 = _TNet(3), _TNet(64)
        self.mlp1 = nn.Sequential(nn.Conv1d(3, 64, 1), nn.BatchNorm1d(64), nn.ReLU())
        self.mlp2 = nn.Sequential(nn.Conv1d(64, 128, 1), nn.BatchNorm1d(128), nn.ReLU(),
                                  nn.Conv1d(128, 1024, 1), nn.BatchNorm1d(1024))
        self.head = nn.Sequential(nn.Linear(1024, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Dropout(0.3),
                                  nn.Linear(512, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, classes))

    def forward(self, pts):  # pts: N, points, 3
        x = pts.transpose(1, 2)
        x = torch.bmm(self.t3(x).transpose(1, 2), x)
        x = self.mlp1(x)
        t = self.t64(x)
        x = torch.bmm(t.transpose(1, 2), x)
        logits = self.head(self.mlp2(x).amax(dim=2))
        eye = torch.eye(64, device=t.device, dtype=t.dtype)
        return logits, (torch.bmm(t, t.transpose(1, 2)) - eye).pow(2).sum(dim=(1, 2)).mean()


def pointnet(batch_size: int = 32, points: int = 2048, classes: int = 40):
    def make_batch(n):
        g = _gen()
        return torch.rand(n, points, 3, generator=g) * 2 - 1, torch.randint(0, classes, (n,), generator=g)

    def loss_fn(model, batch):
        pts, y = batch
        logits, reg = model(pts)
        return F.cross_entropy(logits, y) + 1e-3 * reg

    return Workload(name="pointnet", build_model=lambda: _PointNet(classes), make_batch=make_batch, loss_fn=loss_fn,
                    default_batch_size=batch_size)


def _conv_bn(cin, cout, stride):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class _SimCLR(nn.Module):
    def __init__(self, width, proj):
        super().__init__()
        w = width
        self.encoder = nn.Sequential(_conv_bn(3, w, 1), _conv_bn(w, w, 1), _conv_bn(w, 2 * w, 2),
                                     _conv_bn(2 * w, 2 * w, 1), _conv_bn(2 * w, 4 * w, 2), _conv_bn(4 * w, 4 * w, 1),
                                     _conv_bn(4 * w, 8 * w, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.projector = nn.Sequential(nn.Linear(8 * w, 2048), nn.BatchNorm1d(2048), nn.ReLU(), nn.Linear(2048, proj))

    def forward(self, x):
        return self.projector(self.encoder(x))


def simclr(batch_size: int = 128, image_size: int = 32, width: int = 64, proj: int = 128, temperature: float = 0.2):
    def make_batch(n):
        g = _gen()
        x = torch.rand(n, 3, image_size, image_size, generator=g)
        # two "augmented" views: a flip plus noise, and a brightness jitter plus noise
        return (x.flip(3) + 0.05 * torch.randn(x.shape, generator=g),
                x * (0.8 + 0.4 * torch.rand(n, 1, 1, 1, generator=g)) + 0.05 * torch.randn(x.shape, generator=g))

    def loss_fn(model, batch):
        a, b = batch
        z = F.normalize(model(torch.cat([a, b])), dim=1)
        sim = z @ z.t() / temperature
        n = a.shape[0]
        sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool, device=sim.device), float("-inf"))
        target = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(sim.device)
        return F.cross_entropy(sim, target)

    return Workload(name="simclr", build_model=lambda: _SimCLR(width, proj), make_batch=make_batch, loss_fn=loss_fn,
                    default_batch_size=batch_size, conv_net=True)


class _FTTransformer(nn.Module):
    def __init__(self, n_num, cards, d, layers, heads, classes):
        super().__init__()
        self.num_w = nn.Parameter(torch.randn(n_num, d) * 0.02)
        self.num_b = nn.Parameter(torch.zeros(n_num, d))
        self.cat = nn.ModuleList(nn.Embedding(c, d) for c in cards)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d // 3 * 2, dropout=0.1, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, classes))

    def forward(self, batch):
        num = batch["numeric"].unsqueeze(-1) * self.num_w + self.num_b  # N, n_num, d
        cat = torch.stack([emb(batch["categorical"][:, i]) for i, emb in enumerate(self.cat)], dim=1)
        x = torch.cat([self.cls.expand(num.shape[0], -1, -1), num, cat], dim=1)
        return self.head(self.encoder(x)[:, 0])


def ftt(batch_size: int = 256, numeric: int = 48, categorical: int = 16, cardinality: int = 5000, d: int = 192,
        layers: int = 4, heads: int = 8, classes: int = 10):
    cards = [cardinality // (i + 1) + 2 for i in range(categorical)]

    def make_batch(n):
        g = _gen()
        cats = torch.stack([torch.randint(0, c, (n,), generator=g) for c in cards], dim=1)
        return {"numeric": torch.randn(n, numeric, generator=g), "categorical": cats,
                "label": torch.randint(0, classes, (n,), generator=g)}

    def loss_fn(model, batch):
        return F.cross_entropy(model(batch), batch["label"])

    return Workload(name="ftt", build_model=lambda: _FTTransformer(numeric, cards, d, layers, heads, classes),
                    make_batch=make_batch, loss_fn=loss_fn, default_batch_size=batch_size)

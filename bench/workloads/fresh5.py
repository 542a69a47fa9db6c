"""Workloads written before any estimate of them was looked at, against the public Workload contract only
(docs/design.md; `bench/estimate_accuracy.py --set fresh5`): two with graphs that depend on the data, a vision
transformer that prunes its tokens part-way (how many it keeps follows the attention scores: `int()` of a tensor,
topk and gather) and a one-stage detector whose box loss runs only on the anchors that match an object (boolean-mask
indexing); two without, a Conformer speech encoder (a convolution module with GLU, depthwise conv and BatchNorm
between half-step feed-forwards and nn.MultiheadAttention) and a message-passing graph network over batches of
graphs of varying size (index_add_ over edges, scatter_reduce pooling per graph). Not to be tuned against: a change
of the estimator made for these cases calls for another set.
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
# Token-pruning vision transformer


class _Block(nn.Module):
    def __init__(self, d, heads, mlp=4):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, mlp * d), nn.GELU(), nn.Linear(mlp * d, d))

    def forward(self, x, want_scores=False):
        n, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(n, t, d))
        x = x + self.mlp(self.n2(x))
        # how much the class token attends to each patch, averaged over heads
        return (x, att[:, :, 0, 1:].mean(1)) if want_scores else x


class _PruningViT(nn.Module):
    def __init__(self, image, patch, d, heads, depth, prune_at, classes):
        super().__init__()
        self.embed = nn.Conv2d(3, d, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, d) * 0.02)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(depth))
        self.prune_at = prune_at
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, img):
        x = self.embed(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        for i, blk in enumerate(self.blocks):
            if i in self.prune_at:
                x, scores = blk(x, want_scores=True)
                # keep the patches the class token attends to more than uniformly, as many as the batch's
                # average such count (at least a quarter): the count is read from the data
                keep = max(scores.shape[1] // 4, int((scores > 1.0 / scores.shape[1]).sum()) // scores.shape[0])
                idx = scores.topk(keep, dim=1).indices + 1
                patches = x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))
                x = torch.cat([x[:, :1], patches], 1)
            else:
                x = blk(x)
        return self.head(self.norm(x[:, 0]))


def prune(batch_size: int = 16, image: int = 160, patch: int = 16, d: int = 384, heads: int = 6, depth: int = 8,
          classes: int = 200):
    def make_batch(n):
        g = _gen()
        return torch.randn(n, 3, image, image, generator=g), torch.randint(0, classes, (n,), generator=g)

    def loss_fn(model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    return Workload(name="prune", build_model=lambda: _PruningViT(image, patch, d, heads, depth, (2, 5), classes),
                    make_batch=make_batch, loss_fn=loss_fn, default_batch_size=batch_size)


# ---------------------------------------------------------------------------------------------------------
# One-stage detector


def _conv_bn(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.SiLU())


class _Detector(nn.Module):
    def __init__(self, width, anchors, classes):
        super().__init__()
        w = width
        self.stem = nn.Sequential(_conv_bn(3, w, 2), _conv_bn(w, w))
        self.c3 = nn.Sequential(_conv_bn(w, 2 * w, 2), _conv_bn(2 * w, 2 * w))
        self.c4 = nn.Sequential(_conv_bn(2 * w, 4 * w, 2), _conv_bn(4 * w, 4 * w))
        self.c5 = nn.Sequential(_conv_bn(4 * w, 8 * w, 2), _conv_bn(8 * w, 8 * w))
        self.lat = nn.ModuleList(nn.Conv2d(c, 4 * w, 1) for c in (2 * w, 4 * w, 8 * w))
        self.cls_head = nn.Sequential(_conv_bn(4 * w, 4 * w), nn.Conv2d(4 * w, anchors * classes, 3, padding=1))
        self.box_head = nn.Sequential(_conv_bn(4 * w, 4 * w), nn.Conv2d(4 * w, anchors * 4, 3, padding=1))
        self.anchors, self.classes = anchors, classes

    def forward(self, img):
        c3 = self.c3(self.stem(img))
        c4 = self.c4(c3)
        c5 = self.c5(c4)
        p5 = self.lat[2](c5)
        p4 = self.lat[1](c4) + F.interpolate(p5, scale_factor=2.0, mode="nearest")
        p3 = self.lat[0](c3) + F.interpolate(p4, scale_factor=2.0, mode="nearest")
        logits, boxes = [], []
        for p in (p3, p4, p5):
            n = p.shape[0]
            logits.append(self.cls_head(p).permute(0, 2, 3, 1).reshape(n, -1, self.classes))
            boxes.append(self.box_head(p).permute(0, 2, 3, 1).reshape(n, -1, 4))
        return torch.cat(logits, 1), torch.cat(boxes, 1)


def detector(batch_size: int = 8, image: int = 256, width: int = 32, anchors: int = 3, classes: int = 20):
    cells = sum((image // s) ** 2 for s in (4, 8, 16)) * anchors

    def make_batch(n):
        g = _gen()
        # per anchor: a target class (-1: background; about 3% are matched to an object) and box offsets
        cls = torch.randint(0, classes, (n, cells), generator=g)
        matched = torch.rand(n, cells, generator=g) < 0.03
        return (torch.randn(n, 3, image, image, generator=g), cls.masked_fill(~matched, -1),
                torch.randn(n, cells, 4, generator=g))

    def loss_fn(model, batch):
        img, cls, box = batch
        logits, deltas = model(img)
        pos = cls >= 0
        target = F.one_hot(cls.clamp(min=0), logits.shape[-1]).to(logits.dtype) * pos[..., None]
        p = torch.sigmoid(logits)
        ce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
        focal = (ce * ((1 - p) * target + p * (1 - target)) ** 2).sum()
        # the box loss over the matched anchors only: a data-dependent selection
        box_loss = F.smooth_l1_loss(deltas[pos], box[pos], reduction="sum")
        return (focal + box_loss) / pos.sum().clamp(min=1)

    return Workload(name="detector", build_model=lambda: _Detector(width, anchors, classes),
                    make_batch=make_batch, loss_fn=loss_fn, default_batch_size=batch_size)


# ---------------------------------------------------------------------------------------------------------
# Conformer


class _ConvModule(nn.Module):
    def __init__(self, d, kernel):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.pw1 = nn.Conv1d(d, 2 * d, 1)
        self.dw = nn.Conv1d(d, d, kernel, padding=kernel // 2, groups=d)
        self.bn = nn.BatchNorm1d(d)
        self.pw2 = nn.Conv1d(d, d, 1)

    def forward(self, x):  # N, T, d
        y = F.glu(self.pw1(self.norm(x).transpose(1, 2)), dim=1)
        return self.pw2(F.silu(self.bn(self.dw(y)))).transpose(1, 2)


class _ConformerBlock(nn.Module):
    def __init__(self, d, heads, kernel):
        super().__init__()
        self.ff1 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.SiLU(), nn.Dropout(0.1), nn.Linear(4 * d, d))
        self.att_norm = nn.LayerNorm(d)
        self.att = nn.MultiheadAttention(d, heads, dropout=0.1, batch_first=True)
        self.conv = _ConvModule(d, kernel)
        self.ff2 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.SiLU(), nn.Dropout(0.1), nn.Linear(4 * d, d))
        self.out = nn.LayerNorm(d)

    def forward(self, x):
        x = x + 0.5 * self.ff1(x)
        y = self.att_norm(x)
        x = x + self.att(y, y, y, need_weights=False)[0]
        x = x + self.conv(x)
        return self.out(x + 0.5 * self.ff2(x))


class _Conformer(nn.Module):
    def __init__(self, mels, d, heads, layers, kernel, classes):
        super().__init__()
        self.sub = nn.Sequential(nn.Conv2d(1, d, 3, 2), nn.ReLU(), nn.Conv2d(d, d, 3, 2), nn.ReLU())
        self.proj = nn.Linear(d * (((mels - 1) // 2 - 1) // 2), d)
        self.blocks = nn.Sequential(*(_ConformerBlock(d, heads, kernel) for _ in range(layers)))
        self.head = nn.Linear(d, classes)

    def forward(self, feats):  # N, T, mels
        x = self.sub(feats[:, None])  # N, d, T/4, mels/4
        n, d, t, f = x.shape
        return self.head(self.blocks(self.proj(x.permute(0, 2, 1, 3).reshape(n, t, d * f))))


def conformer(batch_size: int = 8, frames: int = 800, mels: int = 80, d: int = 256, heads: int = 4, layers: int = 8,
              kernel: int = 31, classes: int = 500):
    t_out = ((frames - 1) // 2 - 1) // 2

    def make_batch(n):
        g = _gen()
        return torch.randn(n, frames, mels, generator=g), torch.randint(0, classes, (n, t_out), generator=g)

    def loss_fn(model, batch):
        feats, labels = batch
        return F.cross_entropy(model(feats).flatten(0, 1), labels.flatten())

    return Workload(name="conformer", build_model=lambda: _Conformer(mels, d, heads, layers, kernel, classes),
                    make_batch=make_batch, loss_fn=loss_fn, default_batch_size=batch_size)


# ---------------------------------------------------------------------------------------------------------
# Message-passing graph network


class _MPLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.msg = nn.Sequential(nn.Linear(2 * d + 8, d), nn.SiLU(), nn.Linear(d, d))
        self.upd = nn.Sequential(nn.Linear(2 * d, d), nn.SiLU(), nn.Linear(d, d))
        self.norm = nn.LayerNorm(d)

    def forward(self, h, src, dst, edge_attr):
        m = self.msg(torch.cat([h[src], h[dst], edge_attr], -1))
        agg = torch.zeros_like(h).index_add_(0, dst, m)
        return self.norm(h + self.upd(torch.cat([h, agg], -1)))


class _MPNN(nn.Module):
    def __init__(self, feats, d, layers, classes):
        super().__init__()
        self.inp = nn.Linear(feats, d)
        self.layers = nn.ModuleList(_MPLayer(d) for _ in range(layers))
        self.head = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, classes))

    def forward(self, x, src, dst, edge_attr, graph, graphs):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h, src, dst, edge_attr)
        pooled = torch.zeros(graphs, h.shape[1], dtype=h.dtype).scatter_reduce(
            0, graph[:, None].expand_as(h), h, reduce="mean", include_self=False)
        return self.head(pooled)


def mpnn(batch_size: int = 64, feats: int = 32, d: int = 256, layers: int = 6, classes: int = 10,
         min_nodes: int = 40, max_nodes: int = 120, degree: int = 8):
    def make_batch(n):
        g = _gen()
        sizes = torch.randint(min_nodes, max_nodes + 1, (n,), generator=g)
        offsets = torch.cumsum(sizes, 0) - sizes
        graph = torch.repeat_interleave(torch.arange(n), sizes)
        nodes = int(sizes.sum())
        # `degree` random neighbours per node, within its own graph
        src = torch.arange(nodes).repeat_interleave(degree)
        local = (torch.rand(nodes * degree, generator=g) * sizes[graph].repeat_interleave(degree)).long()
        dst = offsets[graph].repeat_interleave(degree) + local
        return (torch.randn(nodes, feats, generator=g), src, dst, torch.randn(nodes * degree, 8, generator=g),
                graph, torch.randint(0, classes, (n,), generator=g))

    def loss_fn(model, batch):
        x, src, dst, edge_attr, graph, y = batch
        return F.cross_entropy(model(x, src, dst, edge_attr, graph, y.shape[0]), y)

    return Workload(name="mpnn", build_model=lambda: _MPNN(feats, d, layers, classes),
                    make_batch=make_batch, loss_fn=loss_fn, default_batch_size=batch_size)

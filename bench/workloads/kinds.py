"""Workloads of kinds no other set has, written against the public Workload contract only (docs/design.md;
`bench/estimate_accuracy.py --set kinds`): graph message passing through index_add_ with a dict batch, an STFT front
end (complex tensors) before a CNN, 3-D convolutions, a custom autograd.Function with torch.utils.checkpoint inside
the model, multi-hot EmbeddingBag tables with offsets, a diffusion block (GroupNorm, SiLU, einsum attention, a
timestep embedding), a mixture of experts whose routing depends on the data (nonzero: no fake trace), and weight
tying with one module reused three times.

One batch of each in fp32 adamw and bf16 sgd-momentum was measured before any estimate was looked at. diffblock's
allocated peak led to a change of the estimator (a strided input's contiguous copy inside softmax's backward kernel),
so diffblock is not held out; moe casts its expert outputs to the accumulator's dtype, as its bf16 autocast
step needs (index_add_ takes one dtype).
"""
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch import nn

from advisor import Workload


def _g(seed=0):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


# 1. GNN: mean aggregation through index_add_, dict batch
def gnn(batch_size: int = 8, nodes: int = 2000, edges: int = 16000, feat: int = 128, hidden: int = 256,
        layers: int = 4):
    class Layer(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.lin = nn.Linear(2 * d, d)
            self.norm = nn.LayerNorm(d)
        def forward(self, x, src, dst):
            msg = x.index_select(0, src)
            agg = torch.zeros_like(x).index_add_(0, dst, msg)
            deg = torch.zeros(x.shape[0], 1, dtype=x.dtype, device=x.device)
            deg = deg.index_add_(0, dst, torch.ones_like(msg[:, :1]))
            agg = agg / deg.clamp(min=1)
            return x + F.gelu(self.norm(self.lin(torch.cat([x, agg], -1))))

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(feat, hidden)
            self.layers = nn.ModuleList(Layer(hidden) for _ in range(layers))
            self.out = nn.Linear(hidden, 10)
        def forward(self, b):
            x = self.inp(b["x"])
            for layer in self.layers:
                x = layer(x, b["src"], b["dst"])
            return self.out(x)

    def make_batch(n):  # n graphs merged into one disjoint graph
        g = _g()
        N, E = nodes * n, edges * n
        off = torch.arange(n).repeat_interleave(edges) * nodes
        return {"x": torch.randn(N, feat, generator=g),
                "src": torch.randint(0, nodes, (E,), generator=g) + off,
                "dst": torch.randint(0, nodes, (E,), generator=g) + off,
                "y": torch.randint(0, 10, (N,), generator=g)}

    return Workload(name="gnn", build_model=M, make_batch=make_batch,
                    loss_fn=lambda m, b: F.cross_entropy(m(b), b["y"]), default_batch_size=batch_size)


# 2. audio spectrogram CNN: torch.stft (complex) in the forward
def spectro(batch_size: int = 16, samples: int = 32000, n_fft: int = 512, hop: int = 128):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("win", torch.hann_window(n_fft))
            self.net = nn.Sequential(
                nn.Conv2d(1, 32, 3, 1, 1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(32, 64, 3, 1, 1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(64, 128, 3, 1, 1), nn.BatchNorm2d(128), nn.ReLU(),
                nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 35))
        def forward(self, wav):
            spec = torch.stft(wav, n_fft, hop, window=self.win, return_complex=True)
            mag = torch.log1p(spec.abs())
            return self.net(mag.unsqueeze(1))

    return Workload(name="spectro", build_model=M,
                    make_batch=lambda n: (torch.randn(n, samples, generator=_g()),
                                          torch.randint(0, 35, (n,), generator=_g())),
                    loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]), default_batch_size=batch_size)


# 3. video: Conv3d
def video(batch_size: int = 4, frames: int = 16, size: int = 64):
    def build():
        return nn.Sequential(
            nn.Conv3d(3, 32, (3, 7, 7), (1, 2, 2), (1, 3, 3)), nn.BatchNorm3d(32), nn.ReLU(),
            nn.Conv3d(32, 64, 3, 2, 1), nn.BatchNorm3d(64), nn.ReLU(),
            nn.Conv3d(64, 128, 3, 2, 1), nn.BatchNorm3d(128), nn.ReLU(),
            nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(128, 50))
    return Workload(name="video", build_model=build,
                    make_batch=lambda n: (torch.randn(n, 3, frames, size, size, generator=_g()),
                                          torch.randint(0, 50, (n,), generator=_g())),
                    loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]), default_batch_size=batch_size)


# 4. custom autograd.Function + torch.utils.checkpoint inside the model
class _Swish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s * (1 + x * (1 - s)))


def ckpt(batch_size: int = 64, d: int = 1024, blocks: int = 8, use_ckpt: int = 1):
    # use_ckpt=0: the same blocks without checkpoint, for comparison
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(d, 4 * d)
            self.b = nn.Linear(4 * d, d)
            self.n = nn.LayerNorm(d)
        def forward(self, x):
            return x + self.b(_Swish.apply(self.a(self.n(x))))

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))
            self.head = nn.Linear(d, 10)
        def forward(self, x):
            for i, blk in enumerate(self.blocks):
                x = cp.checkpoint(blk, x, use_reentrant=False) if i % 2 == 0 and use_ckpt else blk(x)
            return self.head(x.mean(1))

    return Workload(name="ckpt", build_model=M,
                    make_batch=lambda n: (torch.randn(n, 32, d, generator=_g()),
                                          torch.randint(0, 10, (n,), generator=_g())),
                    loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]), default_batch_size=batch_size)


# 5. EmbeddingBag multi-hot recommender, dict batch with offsets
def bagrec(batch_size: int = 512, rows: int = 200000, dim: int = 64, tables: int = 6, hot: int = 20):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.bags = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(tables))
            self.mlp = nn.Sequential(nn.Linear(tables * dim + 13, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                                     nn.Linear(256, 1))
        def forward(self, b):
            embs = [bag(b["idx"][t], b["off"][t]) for t, bag in enumerate(self.bags)]
            return self.mlp(torch.cat(embs + [b["dense"]], 1)).squeeze(1)

    def make_batch(n):
        g = _g()
        return {"idx": [torch.randint(0, rows, (n * hot,), generator=g) for _ in range(tables)],
                "off": [torch.arange(0, n * hot, hot) for _ in range(tables)],
                "dense": torch.randn(n, 13, generator=g), "y": torch.rand(n, generator=g)}

    return Workload(name="bagrec", build_model=M, make_batch=make_batch,
                    loss_fn=lambda m, b: F.binary_cross_entropy_with_logits(m(b), b["y"]),
                    default_batch_size=batch_size)


# 6. diffusion block: GroupNorm, SiLU, einsum attention, timestep embedding, noise-prediction loss
def diffblock(batch_size: int = 8, size: int = 32, ch: int = 128):
    class Res(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.n1 = nn.GroupNorm(32, c)
            self.c1 = nn.Conv2d(c, c, 3, 1, 1)
            self.t = nn.Linear(256, c)
            self.n2 = nn.GroupNorm(32, c)
            self.c2 = nn.Conv2d(c, c, 3, 1, 1)
        def forward(self, x, temb):
            h = self.c1(F.silu(self.n1(x))) + self.t(temb)[:, :, None, None]
            return x + self.c2(F.silu(self.n2(h)))

    class Attn(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.n = nn.GroupNorm(32, c)
            self.qkv = nn.Conv2d(c, 3 * c, 1)
            self.o = nn.Conv2d(c, c, 1)
        def forward(self, x):
            B, C, H, W = x.shape
            q, k, v = self.qkv(self.n(x)).reshape(B, 3, C, H * W).unbind(1)
            a = torch.einsum("bci,bcj->bij", q, k).mul(C ** -0.5).softmax(-1)
            return x + self.o(torch.einsum("bij,bcj->bci", a, v).reshape(B, C, H, W))

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.temb = nn.Sequential(nn.Linear(128, 256), nn.SiLU(), nn.Linear(256, 256))
            self.inp = nn.Conv2d(3, ch, 3, 1, 1)
            self.r1, self.a, self.r2 = Res(ch), Attn(ch), Res(ch)
            self.out = nn.Sequential(nn.GroupNorm(32, ch), nn.SiLU(), nn.Conv2d(ch, 3, 3, 1, 1))
        def forward(self, x, t):
            half = 64
            f = torch.exp(-torch.arange(half, device=x.device) * (9.21 / half))
            e = t[:, None].float() * f[None]
            temb = self.temb(torch.cat([e.sin(), e.cos()], -1))
            h = self.inp(x)
            h = self.r2(self.a(self.r1(h, temb)), temb)
            return self.out(h)

    def loss(m, b):
        x, t, noise = b
        return F.mse_loss(m(x + noise, t), noise)

    return Workload(name="diffblock", build_model=M,
                    make_batch=lambda n: (torch.randn(n, 3, size, size, generator=_g()),
                                          torch.randint(0, 1000, (n,), generator=_g()),
                                          torch.randn(n, 3, size, size, generator=_g(1))),
                    loss_fn=loss, default_batch_size=batch_size)


# 7. mixture of experts with data-dependent routing (nonzero: output shape depends on data)
def moe(batch_size: int = 32, seq: int = 64, d: int = 256, experts: int = 8):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5000, d)
            self.gate = nn.Linear(d, experts)
            self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                         for _ in range(experts))
            self.head = nn.Linear(d, 5000)
        def forward(self, ids):
            x = self.emb(ids).reshape(-1, d)
            w, top = self.gate(x).softmax(-1).max(-1)
            out = torch.zeros_like(x)
            for e, ex in enumerate(self.experts):
                sel = (top == e).nonzero().squeeze(1)
                out = out.index_add(0, sel, (ex(x[sel]) * w[sel, None]).to(out.dtype))
            return self.head(x + out)

    return Workload(name="moe", build_model=M,
                    make_batch=lambda n: torch.randint(0, 5000, (n, seq), generator=_g()),
                    loss_fn=lambda m, ids: F.cross_entropy(m(ids), ids.roll(-1, 1).reshape(-1)),
                    default_batch_size=batch_size)


# 8. weight tying and one module reused three times (shared parameters)
def tied(batch_size: int = 32, seq: int = 128, d: int = 512, vocab: int = 16000):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.block = nn.TransformerEncoderLayer(d, 8, 4 * d, batch_first=True, norm_first=True, dropout=0.0)
        def forward(self, ids):
            x = self.emb(ids)
            for _ in range(3):
                x = self.block(x)
            return x @ self.emb.weight.t()

    return Workload(name="tied", build_model=M,
                    make_batch=lambda n: torch.randint(0, vocab, (n, seq), generator=_g()),
                    loss_fn=lambda m, ids: F.cross_entropy(m(ids).reshape(-1, vocab), ids.roll(-1, 1).reshape(-1)),
                    default_batch_size=batch_size)

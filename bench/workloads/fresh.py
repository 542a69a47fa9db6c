"""Workloads written before any estimate of them was looked at, against the public Workload contract only
(docs/design.md; `bench/estimate_accuracy.py --set fresh`): a MobileNetV2-style CNN (depthwise convolutions,
inverted residuals, ReLU6), a sequence-to-sequence nn.Transformer (encoder and decoder, causal mask, tuple batches),
a convolutional VAE (transposed convolutions, a reparameterized latent, a two-term loss) and an MLP-Mixer (token
mixing through transposes). Not to be tuned against: a change of the estimator made for these cases calls for
another set.
"""

import torch
import torch.nn.functional as F
from torch import nn

from advisor import Workload


def _gen(seed=0):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _images(n, size, classes):
    return torch.randn(n, 3, size, size, generator=_gen()), torch.randint(0, classes, (n,), generator=_gen())


class _InvertedResidual(nn.Module):
    def __init__(self, cin, cout, stride, expand):
        super().__init__()
        mid = cin * expand
        self.skip = stride == 1 and cin == cout
        self.body = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU6(),
            nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False), nn.BatchNorm2d(mid), nn.ReLU6(),
            nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.body(x)
        return x + y if self.skip else y


def mobilenet(batch_size: int = 16, image_size: int = 128, classes: int = 100):
    # (expansion, channels, repeats, first stride), as in MobileNetV2's table 2
    cfg = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]

    def build():
        layers, c = [nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU6()], 32
        for t, out, n, s in cfg:
            for i in range(n):
                layers.append(_InvertedResidual(c, out, s if i == 0 else 1, t))
                c = out
        layers += [nn.Conv2d(c, 1280, 1, bias=False), nn.BatchNorm2d(1280), nn.ReLU6(),
                   nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(1280, classes)]
        return nn.Sequential(*layers)

    return Workload(name="mobilenet", build_model=build, make_batch=lambda n: _images(n, image_size, classes),
                    loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]), default_batch_size=batch_size)


def seq2seq(batch_size: int = 8, src_len: int = 128, tgt_len: int = 64, d: int = 384, vocab: int = 8000):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.src_emb, self.tgt_emb = nn.Embedding(vocab, d), nn.Embedding(vocab, d)
            self.pos = nn.Parameter(torch.zeros(1, max(src_len, tgt_len), d))
            self.tf = nn.Transformer(d, 6, 3, 3, 4 * d, dropout=0.1, batch_first=True)
            self.out = nn.Linear(d, vocab)

        def forward(self, src, tgt):
            mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
            h = self.tf(self.src_emb(src) + self.pos[:, :src.shape[1]], self.tgt_emb(tgt) + self.pos[:, :tgt.shape[1]],
                        tgt_mask=mask, tgt_is_causal=True)
            return self.out(h)

    def batch(n):
        return (torch.randint(0, vocab, (n, src_len), generator=_gen()),
                torch.randint(0, vocab, (n, tgt_len + 1), generator=_gen(1)))

    def loss(m, b):
        src, tgt = b
        return F.cross_entropy(m(src, tgt[:, :-1]).flatten(0, 1), tgt[:, 1:].flatten())

    return Workload(name="seq2seq", build_model=M, make_batch=batch, loss_fn=loss, default_batch_size=batch_size,
                    tokens_per_sample=tgt_len)


def vae(batch_size: int = 32, image_size: int = 64, latent: int = 128):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            chans, enc, c = (32, 64, 128, 256), [], 3
            for out in chans:
                enc += [nn.Conv2d(c, out, 4, 2, 1), nn.BatchNorm2d(out), nn.LeakyReLU(0.2)]
                c = out
            self.enc = nn.Sequential(*enc, nn.Flatten())
            self.side = image_size // 16
            flat = c * self.side * self.side
            self.mu, self.logvar, self.up = nn.Linear(flat, latent), nn.Linear(flat, latent), nn.Linear(latent, flat)
            dec = []
            for out in (128, 64, 32):
                dec += [nn.ConvTranspose2d(c, out, 4, 2, 1), nn.BatchNorm2d(out), nn.ReLU()]
                c = out
            self.dec = nn.Sequential(*dec, nn.ConvTranspose2d(c, 3, 4, 2, 1))

        def forward(self, x):
            h = self.enc(x)
            mu, logvar = self.mu(h), self.logvar(h)
            z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
            y = self.dec(self.up(z).view(x.shape[0], 256, self.side, self.side))
            return y, mu, logvar

    def loss(m, x):
        y, mu, logvar = m(x)
        kl = -0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())
        return F.mse_loss(y, x) + 1e-3 * kl

    return Workload(name="vae", build_model=M,
                    make_batch=lambda n: torch.randn(n, 3, image_size, image_size, generator=_gen()),
                    loss_fn=loss, default_batch_size=batch_size)


def mixer(batch_size: int = 16, image_size: int = 96, patch: int = 8, dim: int = 384, depth: int = 8,
          classes: int = 100):
    tokens = (image_size // patch) ** 2

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.tok = nn.Sequential(nn.Linear(tokens, dim // 2), nn.GELU(), nn.Linear(dim // 2, tokens))
            self.ch = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, x):  # x: (n, tokens, dim)
            x = x + self.tok(self.n1(x).transpose(1, 2)).transpose(1, 2)
            return x + self.ch(self.n2(x))

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, dim, patch, patch)
            self.blocks = nn.Sequential(*[Block() for _ in range(depth)])
            self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

        def forward(self, x):
            h = self.blocks(self.stem(x).flatten(2).transpose(1, 2))
            return self.head(self.norm(h).mean(1))

    return Workload(name="mixer", build_model=M, make_batch=lambda n: _images(n, image_size, classes),
                    loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]), default_batch_size=batch_size)

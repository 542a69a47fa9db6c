"""Workloads written outside the presets, against the public Workload contract only (docs/design.md), so the
estimator's accuracy is also checked on models it was not developed on (`bench/estimate_accuracy.py
--set unseen`): a frozen convolutional backbone under a trainable head (parameters without
gradients), a GRU language model, a pre-norm transformer encoder (nn.TransformerEncoder, dropout,
dict batches), and a 1-D convolutional audio classifier (BatchNorm1d, GELU, dropout).
"""

import torch
import torch.nn.functional as F
from torch import nn

from advisor import Workload


def _gen(seed=0):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def frozen(batch_size: int = 32, image_size: int = 96):
    def build():
        layers, c = [], 3
        for out in (64, 128, 256, 512):
            layers += [nn.Conv2d(c, out, 3, stride=2, padding=1), nn.BatchNorm2d(out), nn.ReLU()]
            c = out
        backbone = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        for p in backbone.parameters():
            p.requires_grad_(False)
        return nn.Sequential(backbone, nn.Linear(512, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                             nn.Linear(4096, 100))
    return Workload(name="frozen", build_model=build,
                    make_batch=lambda n: (torch.randn(n, 3, image_size, image_size, generator=_gen()),
                                          torch.randint(0, 100, (n,), generator=_gen())),
                    loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]), default_batch_size=batch_size)


def gru(batch_size: int = 32, seq_len: int = 64, hidden: int = 512):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20000, hidden)
            self.rnn = nn.GRU(hidden, hidden, num_layers=2, batch_first=True)
            self.out = nn.Linear(hidden, 20000)
        def forward(self, x):
            return self.out(self.rnn(self.emb(x))[0])
    return Workload(name="gru", build_model=M,
                    make_batch=lambda n: torch.randint(0, 20000, (n, seq_len + 1), generator=_gen()),
                    loss_fn=lambda m, b: F.cross_entropy(m(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten()),
                    default_batch_size=batch_size)


def encoder(batch_size: int = 8, seq_len: int = 256, d: int = 512, layers: int = 6):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(80, d)
            layer = nn.TransformerEncoderLayer(d, 8, 4 * d, dropout=0.1, batch_first=True, norm_first=True)
            self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(d, 500)
        def forward(self, x):
            return self.head(self.enc(self.inp(x)))
    return Workload(name="encoder", build_model=M,
                    make_batch=lambda n: {"feats": torch.randn(n, seq_len, 80, generator=_gen()),
                                          "labels": torch.randint(0, 500, (n, seq_len), generator=_gen())},
                    loss_fn=lambda m, b: F.cross_entropy(m(b["feats"]).flatten(0, 1), b["labels"].flatten()),
                    default_batch_size=batch_size)


def audio(batch_size: int = 16, samples: int = 16000):
    def build():
        layers, c = [], 1
        for out, k, s in ((64, 10, 5), (128, 3, 2), (128, 3, 2), (256, 3, 2), (256, 3, 2), (512, 2, 2)):
            layers += [nn.Conv1d(c, out, k, stride=s), nn.BatchNorm1d(out), nn.GELU()]
            c = out
        return nn.Sequential(*layers, nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(512, 35))
    return Workload(name="audio", build_model=build,
                    make_batch=lambda n: (torch.randn(n, 1, samples, generator=_gen()),
                                          torch.randint(0, 35, (n,), generator=_gen())),
                    loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]), default_batch_size=batch_size)

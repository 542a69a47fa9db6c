"""A bidirectional LSTM tagger over packed sequences of varying length, for the tests: its graph depends on
the batch's lengths (the LSTM steps over the sequences still running at each time step), so traces at two
batch sizes make different allocations, and fake tensors cannot trace it at all (pack_padded_sequence has a
data-dependent output shape)."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from advisor import Workload


class _Tagger(nn.Module):
    def __init__(self, vocab: int, dim: int, hidden: int, tags: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.lstm = nn.LSTM(dim, hidden, batch_first=True, bidirectional=True)
        self.out = nn.Linear(2 * hidden, tags)

    def forward(self, tokens, lengths):
        packed = pack_padded_sequence(self.embed(tokens), lengths, batch_first=True, enforce_sorted=False)
        out, _ = pad_packed_sequence(self.lstm(packed)[0], batch_first=True, total_length=tokens.shape[1])
        return self.out(out)


def build(max_len: int = 48, vocab: int = 2000, dim: int = 64, hidden: int = 96, tags: int = 12) -> Workload:
    def make_batch(n):
        g = torch.Generator().manual_seed(0)
        # lengths from max_len // 4 to max_len, spread evenly over any batch (i x a stride prime to the
        # span): its tokens grow in step with the batch, and which lengths it holds, and so its graph, do not
        span = max_len - max_len // 4 + 1
        lengths = max_len - (torch.arange(n) * 29) % span
        pad = torch.arange(max_len)[None] >= lengths[:, None]
        tokens = torch.randint(1, vocab, (n, max_len), generator=g).masked_fill(pad, 0)
        return tokens, torch.randint(0, tags, (n, max_len), generator=g).masked_fill(pad, -100), lengths

    def loss_fn(model, batch):
        tokens, labels, lengths = batch
        return F.cross_entropy(model(tokens, lengths).flatten(0, 1), labels.flatten(), ignore_index=-100)

    return Workload(name="packed-tagger", build_model=lambda: _Tagger(vocab, dim, hidden, tags),
                    make_batch=make_batch, loss_fn=loss_fn, default_batch_size=16)

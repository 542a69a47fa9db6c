"""A user workload without a dataset (for `recommend`'s per-1e6-samples epoch)."""

import torch

import advisor


def build() -> advisor.Workload:
    return advisor.Workload(name="no-dataset-mlp", build_model=lambda: torch.nn.Linear(16, 4),
                            make_batch=lambda n: (torch.randn(n, 16), torch.randint(0, 4, (n,))),
                            loss_fn=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))

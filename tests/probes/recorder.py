"""A workload that records, from inside the trial, what the trial applied (tests read its log).

`build(out_dir, fail=...)` also fails on purpose in the ways a trial must survive: an exception,
an abort, a segfault, a hang, or memory growing without bound.
"""

from __future__ import annotations

import ctypes
import json
import os
import time

import torch
from torch import nn
from torch.utils.data import Dataset

import advisor


class Samples(Dataset):
    """Images (3, 8, 8), labels, and the pid and CPU mask of the process that produced each sample."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        cpus = torch.tensor(sum(1 << c for c in os.sched_getaffinity(0)))  # this worker's CPUs, as a bit mask
        return torch.randn(3, 8, 8, generator=g), torch.randint(0, 4, (), generator=g), torch.tensor(os.getpid()), cpus


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()) for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def _children() -> list[int]:
    """Pids of this process's children (its DataLoader workers), from /proc."""
    out: list[int] = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/children") as f:
            out += [int(p) for p in f.read().split()]
    return sorted(out)


def _parent(pid: int) -> int:
    """The parent of process `pid` (of this rank's parent, the fork server: the process that started the server)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _fail(fail: str, hog: list, out) -> None:
    if fail == "abort-on-bf16" and out.dtype == torch.bfloat16:  # crashes in some configurations only
        os.abort()
    if fail == "raise":
        raise ValueError("the workload failed on purpose")
    if fail == "abort":
        os.abort()
    if fail == "segv":
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    if fail == "hang":
        time.sleep(3600)
    if fail == "alloc":
        while True:  # 64 MiB a step until something stops us
            hog.append(torch.ones(16 * 2**20))


def build(out_dir: str, fail: str = "none", samples: int = 256):
    hog: list = []
    log_path = os.path.join(out_dir, f"log-{fail}.jsonl")

    def loss_fn(model, batch):
        x, y, pids, masks = batch
        out = model(x)
        with open(log_path, "a") as f:
            f.write(json.dumps({
                "pid": os.getpid(), "sample_pids": sorted(set(pids.tolist())),
                "sample_cpus": sorted({tuple(c for c in range(64) if m >> c & 1) for m in masks.tolist()}),
                "out_dtype": str(out.dtype),
                "channels_last": x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous(),
                "threads": torch.get_num_threads(), "affinity": sorted(os.sched_getaffinity(0)),
                "rank": os.environ.get("RANK"), "children": _children(), "server_parent": _parent(os.getppid()),
            }) + "\n")
        _fail(fail, hog, out)
        return nn.functional.cross_entropy(out.float(), y)

    return advisor.Workload(
        name=f"recorder-{fail}",
        build_model=Net,
        make_batch=lambda n: (torch.randn(n, 3, 8, 8), torch.randint(0, 4, (n,)), torch.zeros(n, dtype=torch.long),
                              torch.zeros(n, dtype=torch.long)),
        loss_fn=loss_fn,
        dataset=lambda: Samples(samples),
        conv_net=True,
    )

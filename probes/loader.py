"""The trial's input pipeline: a DataLoader over the workload's dataset (or batches from its
make_batch), with every DataLoader knob of the TrainingConfig applied, cycling epochs forever."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from advisor.errors import TrialError
from advisor.trial import TrainingConfig
from advisor.workload import Workload


class _MadeBatches(IterableDataset):
    """Whole batches from the workload's make_batch, for workloads without a dataset.

    Each worker (or the main process) yields make_batch(batch_size) forever; the DataLoader
    runs with batch_size=None, so it neither splits nor collates them.
    """

    def __init__(self, make_batch: Callable[[int], Any], batch_size: int) -> None:
        self.make_batch, self.batch_size = make_batch, batch_size

    def __iter__(self) -> Iterator[Any]:
        while True:
            yield self.make_batch(self.batch_size)


def build_loader(workload: Workload, config: TrainingConfig, *, rank: int = 0, world_size: int = 1,
                 worker_init_fn: Callable[[int], None] | None = None, seed: int = 0) -> DataLoader:
    """The DataLoader a user of this config would write (drop_last, shuffled, sharded by rank)."""
    kw: dict[str, Any] = dict(num_workers=config.num_workers, pin_memory=config.pin_memory,
                              worker_init_fn=worker_init_fn)
    if config.num_workers:
        kw.update(persistent_workers=config.persistent_workers)
        if config.prefetch_factor is not None:
            kw["prefetch_factor"] = config.prefetch_factor
    if workload.dataset is None:
        return DataLoader(_MadeBatches(workload.make_batch, config.batch_size), batch_size=None, **kw)
    dataset: Dataset = workload.dataset()
    size = len(dataset)  # type: ignore[arg-type]
    if size < config.batch_size * world_size:
        raise TrialError(f"{workload.name}'s dataset has {size} samples, fewer than one batch of "
                         f"{config.batch_size} per rank x {world_size} rank(s); give the workload more samples")
    generator = torch.Generator().manual_seed(seed)
    if world_size > 1:
        from torch.utils.data.distributed import DistributedSampler

        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                     drop_last=True)
        return DataLoader(dataset, batch_size=config.batch_size, sampler=sampler, drop_last=True,
                          collate_fn=workload.collate_fn, generator=generator, **kw)
    return DataLoader(dataset, batch_size=config.batch_size, shuffle=True, drop_last=True,
                      collate_fn=workload.collate_fn, generator=generator, **kw)


def cycle(loader: DataLoader) -> Iterator[Any]:
    """Batches forever: a new epoch (and, without persistent workers, new workers) at each end."""
    epoch = 0
    while True:
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        got = False
        for batch in loader:
            got = True
            yield batch
        if not got:
            raise TrialError("the DataLoader produced no batch in a whole epoch")
        epoch += 1


def to_device(batch: Any, device: str, *, non_blocking: bool, channels_last: bool) -> Any:
    """Move every tensor of a batch to `device`; 4-D float inputs to NHWC when channels_last."""
    from torch.utils._pytree import tree_map

    def move(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if device != "cpu":
            x = x.to(device, non_blocking=non_blocking)
        if channels_last and x.dim() == 4 and x.is_floating_point():
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    return tree_map(move, batch)

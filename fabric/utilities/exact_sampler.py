"""Samplers that give every sample to exactly one rank: no padding with duplicates, nothing dropped.

`DistributedSampler` pads the index list with repeated samples until it divides evenly by the number of
ranks, so an evaluation over several ranks counts some samples twice. These samplers split the same index
list (the same permutation for a given seed and epoch) without padding: rank r reads positions
r, r + num_replicas, r + 2 * num_replicas, ... So ranks may get different numbers of samples (at most one apart)
and therefore different numbers of batches; what that means for the loop is in docs/exact_evaluation.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import cast

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, Sampler, SequentialSampler

from fabric.utilities.data import (
    DistributedSamplerWrapper,
    _active_sampler,
    _rebuild_dataloader,
    _RebuildContext,
    _seeded_global_rngs,
    has_iterable_dataset,
    is_distributed_sampler,
)
from fabric.utilities.exceptions import FabricValueError


def exact_share(total: int, num_replicas: int, rank: int) -> int:
    """How many of ``total`` indices rank ``rank`` reads when they are dealt out one by one."""
    return len(range(rank, total, num_replicas))


class ExactDistributedSampler(DistributedSampler):
    """Like ``DistributedSampler(drop_last=False)`` with the same order, but without the padding.

    Deterministic given ``(seed, epoch)``: with ``shuffle=True`` every rank draws
    ``torch.randperm(len(dataset))`` from a generator seeded with ``seed + epoch``, as ``DistributedSampler``
    does, and keeps every ``num_replicas``-th index from position ``rank``. ``len()`` is this rank's exact count.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, shuffle: bool = True, seed: int = 0) -> None:
        super().__init__(dataset, num_replicas, rank, shuffle=shuffle, seed=seed, drop_last=False)
        self.total_size = len(cast(Sized, dataset))
        self.num_samples = exact_share(self.total_size, num_replicas, rank)

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(self.total_size, generator=generator).tolist()
        else:
            indices = list(range(self.total_size))
        return iter(indices[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


class ExactDistributedSamplerWrapper(DistributedSamplerWrapper):
    """Shards any sized sampler's indices like `ExactDistributedSampler`: its own order, dealt out, no padding."""

    def __init__(self, sampler: Sampler, num_replicas: int, rank: int, seed: int = 0) -> None:
        super().__init__(sampler, num_replicas, rank, drop_last=False, seed=seed)
        self.total_size = len(cast(Sized, sampler))
        self.num_samples = exact_share(self.total_size, num_replicas, rank)

    def __iter__(self) -> Iterator[int]:
        with _seeded_global_rngs(self.seed + self.epoch):
            indices = list(self.sampler)
        if len(indices) != self.total_size:
            # len() promised every rank a count; a different number of indices would break that promise silently.
            raise FabricValueError(
                f"setup_dataloaders(even_batches=False): the loader's {type(self.sampler).__name__} yielded "
                f"{len(indices)} indices but its len() is {self.total_size}, so the per-rank counts would be wrong. "
                "Make its __len__ return the number of indices it yields."
            )
        return iter(indices[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


def is_exact_sampler(sampler: object) -> bool:
    """Whether the sampler already gives this rank an unpadded share."""
    return isinstance(sampler, (ExactDistributedSampler, ExactDistributedSamplerWrapper))


def _to_exact(sampler: Sampler, num_replicas: int, rank: int, seed: int) -> DistributedSampler:
    """The exact sampler that gives this rank its share of ``sampler``'s indices, in the same order as today's."""
    # Exact types only, as for the padded samplers: a subclass may change the order, which only the wrapper keeps.
    if type(sampler) is RandomSampler and not sampler.replacement:
        dataset = cast(Dataset, sampler.data_source)
        if sampler.num_samples == len(cast(Sized, dataset)):
            return ExactDistributedSampler(dataset, num_replicas, rank, shuffle=True, seed=seed)
    if type(sampler) is SequentialSampler:
        return ExactDistributedSampler(cast(Dataset, sampler.data_source), num_replicas, rank, shuffle=False)
    return ExactDistributedSamplerWrapper(sampler, num_replicas, rank, seed=seed)


def check_exact_possible(dataloader: DataLoader, caller: str) -> None:
    """Raise if this loader cannot be sharded so that every sample is read exactly once."""
    name = f"{caller}(even_batches=False)"
    if has_iterable_dataset(dataloader):
        raise FabricValueError(
            f"{name}: the loader reads an IterableDataset ({type(dataloader.dataset).__name__}), which has no "
            "indices to deal out, so fabric cannot give each sample to exactly one rank. Use a map-style Dataset "
            "(with __getitem__ and __len__), or shard the IterableDataset yourself and leave even_batches=True."
        )
    if dataloader.drop_last or getattr(dataloader.batch_sampler, "drop_last", False):
        raise FabricValueError(
            f"{name}: the loader has drop_last=True, which drops each rank's last partial batch, so samples "
            "would be missing from the evaluation. Build the loader with drop_last=False."
        )
    current = getattr(dataloader.batch_sampler, "sampler", None)
    current = dataloader.sampler if current is None else current  # not `or`: an empty sampler is falsy
    if is_distributed_sampler(current) and not is_exact_sampler(current):
        raise FabricValueError(
            f"{name}: the loader already has a {type(current).__name__}, which pads the last shard with "
            "repeated samples. Pass the loader with its plain sampler (shuffle=True/False) and let fabric shard "
            "it, or use ExactDistributedSampler from fabric.utilities.exact_sampler yourself."
        )


def inject_exact_sampler(
    dataloader: DataLoader, num_replicas: int, rank: int, seed: int = 0, caller: str = "setup_dataloaders"
) -> DataLoader:
    """Return a loader that reads this rank's exact, unpadded share of the data (see `ExactDistributedSampler`).

    A ``RandomSampler`` keeps ``DistributedSampler(shuffle=True, seed=seed)``'s permutation, a
    ``SequentialSampler`` the dataset order, any other sampler its own order through
    ``ExactDistributedSamplerWrapper``. The loader is rebuilt as ``inject_distributed_sampler`` rebuilds it.
    """
    check_exact_possible(dataloader, caller)
    ctx = _RebuildContext(caller, "with an exact distributed sampler", "pass even_batches=True")
    active = _active_sampler(dataloader, ctx)
    if is_exact_sampler(active):
        return dataloader
    return _rebuild_dataloader(dataloader, _to_exact(active, num_replicas, rank, seed), {}, ctx)

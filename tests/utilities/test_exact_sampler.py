"""ExactDistributedSampler and its wrapper: every index on exactly one rank, today's order, exact len()."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    Sampler,
    TensorDataset,
    WeightedRandomSampler,
)

from fabric.utilities.exact_sampler import (
    ExactDistributedSampler,
    ExactDistributedSamplerWrapper,
    exact_share,
    inject_exact_sampler,
)


def _shards(make: Any, replicas: int) -> list[list[int]]:
    return [list(make(rank)) for rank in range(replicas)]


@pytest.mark.parametrize("total", [1001, 7, 1, 0])
@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_index_on_exactly_one_rank_with_exact_lengths(total: int, replicas: int, shuffle: bool) -> None:
    data = range(total)
    samplers = [ExactDistributedSampler(data, replicas, r, shuffle=shuffle, seed=3) for r in range(replicas)]  # type: ignore[arg-type]
    shards = [list(s) for s in samplers]
    assert sorted(i for shard in shards for i in shard) == list(range(total)), "nothing padded, nothing dropped"
    assert (
        [len(s) for s in samplers]
        == [len(shard) for shard in shards]
        == [exact_share(total, replicas, r) for r in range(replicas)]
    )
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("epoch", [0, 5])
def test_the_order_is_distributed_samplers_without_the_padding(shuffle: bool, epoch: int) -> None:
    data = range(11)
    for rank in range(2):
        exact = ExactDistributedSampler(data, 2, rank, shuffle=shuffle, seed=7)  # type: ignore[arg-type]
        padded = DistributedSampler(data, 2, rank, shuffle=shuffle, seed=7)  # type: ignore[arg-type]
        exact.set_epoch(epoch)
        padded.set_epoch(epoch)
        assert list(exact) == list(padded)[: len(exact)]


def test_deterministic_given_seed_and_epoch_and_reshuffled_per_epoch() -> None:
    a = ExactDistributedSampler(range(50), 2, 0, shuffle=True, seed=1)  # type: ignore[arg-type]
    b = ExactDistributedSampler(range(50), 2, 0, shuffle=True, seed=1)  # type: ignore[arg-type]
    first = list(a)
    assert first == list(b) == list(a)
    a.set_epoch(1)
    assert list(a) != first
    b.set_epoch(1)
    assert list(a) == list(b)


class _Reversed(Sampler[int]):
    def __init__(self, n: int, claimed: int | None = None) -> None:
        self.n, self.claimed = n, claimed

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n if self.claimed is None else self.claimed


def test_wrapper_deals_out_a_custom_samplers_own_order() -> None:
    shards = _shards(lambda r: ExactDistributedSamplerWrapper(_Reversed(7), 2, r), 2)
    assert shards == [[6, 4, 2, 0], [5, 3, 1]]
    assert len(ExactDistributedSamplerWrapper(_Reversed(7), 2, 1)) == 3


def test_wrapper_keeps_random_samplers_disjoint_across_ranks() -> None:
    weights = torch.ones(9)
    shards = _shards(lambda r: ExactDistributedSamplerWrapper(WeightedRandomSampler(weights, 9), 2, r, seed=4), 2)
    torch.rand(3)  # the global RNG moves on between the ranks' draws; their shards must not
    again = _shards(lambda r: ExactDistributedSamplerWrapper(WeightedRandomSampler(weights, 9), 2, r, seed=4), 2)
    assert shards == again and [len(s) for s in shards] == [5, 4]


def test_wrapper_refuses_a_sampler_whose_len_lies() -> None:
    sampler = ExactDistributedSamplerWrapper(_Reversed(7, claimed=9), 2, 0)
    with pytest.raises(ValueError, match=r"_Reversed yielded 7 indices but its len\(\) is 9"):
        list(sampler)


def _loader(n: int, **kwargs: Any) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(n)), **kwargs)


@pytest.mark.parametrize("shuffle", [True, False])
def test_inject_rebuilds_the_loader_with_exact_batch_counts(shuffle: bool) -> None:
    loaders = [inject_exact_sampler(_loader(7, batch_size=2, shuffle=shuffle), 2, r) for r in range(2)]
    assert [len(loader) for loader in loaders] == [2, 2]  # 4 and 3 samples
    seen = [int(i) for loader in loaders for (batch,) in loader for i in batch]
    assert sorted(seen) == list(range(7))
    assert all(isinstance(loader.sampler, ExactDistributedSampler) for loader in loaders)
    assert loaders[0].sampler.shuffle is shuffle  # type: ignore[attr-defined]


def test_inject_gives_a_rank_with_no_samples_no_batches() -> None:
    loaders = [inject_exact_sampler(_loader(1, batch_size=4), 2, r) for r in range(2)]
    assert [len(loader) for loader in loaders] == [1, 0]
    assert [len(list(loader)) for loader in loaders] == [1, 0]


def test_inject_keeps_a_custom_batch_sampler() -> None:
    class _MyBatches(BatchSampler):
        pass

    loader = DataLoader(TensorDataset(torch.arange(5)), batch_sampler=_MyBatches(_Reversed(5), 2, False))
    rebuilt = inject_exact_sampler(loader, 2, 0)
    assert type(rebuilt.batch_sampler) is _MyBatches
    assert [batch.tolist() for (batch,) in rebuilt] == [[4, 2], [0]]


def test_inject_leaves_an_exact_loader_alone() -> None:
    loader = inject_exact_sampler(_loader(5, batch_size=2), 2, 0)
    assert inject_exact_sampler(loader, 2, 0) is loader


class _Stream(IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(range(3))


def test_inject_refuses_an_iterable_dataset() -> None:
    with pytest.raises(ValueError, match=r"setup_dataloaders\(even_batches=False\): the loader reads an IterableData"):
        inject_exact_sampler(DataLoader(_Stream()), 2, 0)


def test_inject_refuses_drop_last() -> None:
    with pytest.raises(ValueError, match=r"the loader has drop_last=True, which drops each rank's last partial"):
        inject_exact_sampler(_loader(5, batch_size=2, drop_last=True), 2, 0)


def test_inject_refuses_a_padding_distributed_sampler() -> None:
    dataset = TensorDataset(torch.arange(5))
    loader = DataLoader(dataset, sampler=DistributedSampler(dataset, 2, 0))
    with pytest.raises(ValueError, match=r"already has a DistributedSampler, which pads the last shard"):
        inject_exact_sampler(loader, 2, 0)

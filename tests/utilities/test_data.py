"""Tests for rebuilding DataLoaders with distributed samplers and seeded worker_init_fns."""

from __future__ import annotations

import functools
import inspect
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    WeightedRandomSampler,
)
from torch.utils.data._utils.collate import default_convert

from fabric.utilities.data import (
    DistributedSamplerWrapper,
    add_worker_init_fn,
    has_iterable_dataset,
    inject_distributed_sampler,
    is_distributed_sampler,
)
from fabric.utilities.seed import worker_init_function


class _RangeDataset(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class _Stream(IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(range(4))


class _ReversedSampler(Sampler[int]):
    def __init__(self, n: int) -> None:
        self.n = n
        self.epochs: list[int] = []

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


class _TaggedBatchSampler(BatchSampler):
    def __init__(self, sampler: Sampler[int], batch_size: int, drop_last: bool, tag: str) -> None:
        super().__init__(sampler, batch_size, drop_last)
        self.tag = tag


class _PairBatchSampler:
    """Batches pairs of indices but keeps no reference to the sampler it uses."""

    def __init__(self, n: int) -> None:
        self._pairs = [[i, i + 1] for i in range(0, n, 2)]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._pairs)

    def __len__(self) -> int:
        return len(self._pairs)


class _LoaderWithExtra(DataLoader):
    def __init__(self, dataset: Dataset, extra: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(dataset, *args, **kwargs)
        self.extra = extra


class _LoaderForgetsArg(DataLoader):
    def __init__(self, dataset: Dataset, foo: int, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)


class _LoaderWithoutSampler(DataLoader):
    def __init__(self, dataset: Dataset, batch_size: int) -> None:
        super().__init__(dataset, batch_size=batch_size, shuffle=True)


class _LoaderWithOptionalArg(DataLoader):
    def __init__(self, dataset: Dataset, mode: str = "default", **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.seen_mode = mode


def _indices(loader: DataLoader) -> list[int]:
    return [int(i) for batch in loader for i in torch.as_tensor(batch).reshape(-1)]


def _double(batch: list[int]) -> torch.Tensor:
    return torch.tensor(batch) * 2


def _noop_init(worker_id: int) -> None:
    pass


def test_has_iterable_dataset() -> None:
    assert has_iterable_dataset(DataLoader(_Stream()))
    assert not has_iterable_dataset(DataLoader(_RangeDataset(4)))


def test_is_distributed_sampler() -> None:
    dataset = _RangeDataset(4)
    assert is_distributed_sampler(DistributedSampler(dataset, num_replicas=2, rank=0))
    assert is_distributed_sampler(DistributedSamplerWrapper(SequentialSampler(dataset), 2, 1))
    assert not is_distributed_sampler(RandomSampler(dataset))
    assert not is_distributed_sampler(None)


def test_random_sampler_becomes_shuffled_distributed_sampler() -> None:
    loader = DataLoader(_RangeDataset(10), batch_size=2, shuffle=True)
    new = inject_distributed_sampler(loader, num_replicas=2, rank=1, seed=7)
    assert type(new.sampler) is DistributedSampler
    assert new.sampler.shuffle
    assert (new.sampler.seed, new.sampler.num_replicas, new.sampler.rank) == (7, 2, 1)
    assert new.batch_size == 2
    assert loader.sampler is not new.sampler  # the original loader is left alone
    assert _indices(new) != list(range(1, 10, 2))


def test_sequential_sampler_becomes_ordered_distributed_sampler() -> None:
    new = inject_distributed_sampler(DataLoader(_RangeDataset(10), batch_size=2), num_replicas=2, rank=1)
    assert type(new.sampler) is DistributedSampler
    assert not new.sampler.shuffle
    assert _indices(new) == [1, 3, 5, 7, 9]


@pytest.mark.parametrize(
    "make_sampler",
    [
        RandomSampler,
        SequentialSampler,
        # Every rank builds its own sampler with the same weights, as ranks running one script do.
        lambda ds: WeightedRandomSampler(torch.arange(1.0, len(ds) + 1), len(ds), replacement=False),
        lambda ds: _ReversedSampler(len(ds)),
    ],
    ids=["random", "sequential", "weighted", "custom"],
)
@pytest.mark.parametrize("size", [10, 9])
def test_shards_are_disjoint_and_cover_the_dataset(make_sampler: Any, size: int) -> None:
    dataset = _RangeDataset(size)
    shards = []
    for rank in range(2):
        loader = DataLoader(dataset, batch_size=3, sampler=make_sampler(dataset))
        shards.append(_indices(inject_distributed_sampler(loader, num_replicas=2, rank=rank, seed=3)))
    assert len(shards[0]) == len(shards[1]) == 5
    combined = shards[0] + shards[1]
    assert sorted(set(combined)) == list(range(size))
    # Padding repeats exactly as many indices as were missing to split evenly.
    assert len(combined) - len(set(combined)) == 10 - size


def test_custom_sampler_order_is_kept_without_extra_shuffling() -> None:
    loader = DataLoader(_RangeDataset(10), batch_size=5, sampler=_ReversedSampler(10))
    new = inject_distributed_sampler(loader, num_replicas=2, rank=0)
    assert isinstance(new.sampler, DistributedSamplerWrapper)
    assert _indices(new) == [9, 7, 5, 3, 1]


def test_wrapper_ranks_agree_on_random_draws_and_leave_global_rng_alone() -> None:
    weights = torch.tensor([0.1, 0.5, 1.0, 2.0, 0.3, 0.7])
    sampler = WeightedRandomSampler(weights, num_samples=12, replacement=True)
    full = list(DistributedSamplerWrapper(sampler, num_replicas=1, rank=0, seed=5))
    state = torch.get_rng_state()
    python_state = random.getstate()
    ranks = [list(DistributedSamplerWrapper(sampler, num_replicas=3, rank=r, seed=5)) for r in range(3)]
    assert torch.equal(torch.get_rng_state(), state)
    assert random.getstate() == python_state
    assert [ranks[i % 3][i // 3] for i in range(12)] == full


def test_wrapper_length_padding_and_drop_last() -> None:
    sampler = _ReversedSampler(9)
    padded = DistributedSamplerWrapper(sampler, num_replicas=2, rank=1)
    dropped = DistributedSamplerWrapper(sampler, num_replicas=2, rank=1, drop_last=True)
    assert len(padded) == len(list(padded)) == 5
    assert list(padded) == [7, 5, 3, 1, 8]  # padded with the first index of the wrapped order
    assert len(dropped) == len(list(dropped)) == 4
    assert list(dropped) == [7, 5, 3, 1]


def test_wrapper_forwards_set_epoch() -> None:
    sampler = _ReversedSampler(4)
    wrapper = DistributedSamplerWrapper(sampler, num_replicas=2, rank=0)
    wrapper.set_epoch(3)
    assert wrapper.epoch == 3
    assert sampler.epochs == [3]


def test_wrapper_rejects_sampler_without_length() -> None:
    match = r"DistributedSamplerWrapper\(range_iterator\): the sampler has no __len__"
    with pytest.raises(TypeError, match=match):
        DistributedSamplerWrapper(iter(range(4)), num_replicas=2, rank=0)  # type: ignore[arg-type]


def test_iterable_dataset_is_untouched() -> None:
    loader = DataLoader(_Stream(), batch_size=2)
    assert inject_distributed_sampler(loader, num_replicas=2, rank=0) is loader


def test_already_distributed_sampler_is_untouched() -> None:
    dataset = _RangeDataset(8)
    loader = DataLoader(dataset, sampler=DistributedSampler(dataset, num_replicas=2, rank=0))
    assert inject_distributed_sampler(loader, num_replicas=2, rank=0) is loader
    batch_sampler = BatchSampler(DistributedSampler(dataset, num_replicas=2, rank=0), 2, False)
    loader = DataLoader(dataset, batch_sampler=batch_sampler)
    assert inject_distributed_sampler(loader, num_replicas=2, rank=0) is loader


def test_plain_batch_sampler_is_unpacked() -> None:
    dataset = _RangeDataset(10)
    loader = DataLoader(dataset, batch_sampler=BatchSampler(SequentialSampler(dataset), 4, drop_last=True))
    new = inject_distributed_sampler(loader, num_replicas=2, rank=0)
    assert (new.batch_size, new.drop_last) == (4, True)
    assert type(new.batch_sampler) is BatchSampler
    assert _indices(new) == [0, 2, 4, 6]


def test_custom_batch_sampler_is_rebuilt() -> None:
    dataset = _RangeDataset(10)
    loader = DataLoader(dataset, batch_sampler=_TaggedBatchSampler(SequentialSampler(dataset), 2, False, "x"))
    new = inject_distributed_sampler(loader, num_replicas=2, rank=1)
    assert type(new.batch_sampler) is _TaggedBatchSampler
    assert new.batch_sampler.tag == "x"
    assert new.batch_sampler.batch_size == 2
    assert type(new.batch_sampler.sampler) is DistributedSampler
    assert list(new.batch_sampler) == [[1, 3], [5, 7], [9]]


def test_batch_sampler_without_sampler_attribute_raises() -> None:
    loader = DataLoader(_RangeDataset(4), batch_sampler=_PairBatchSampler(4))
    match = r"setup_dataloaders\(_PairBatchSampler\): cannot rebuild this batch sampler"
    with pytest.raises(TypeError, match=match) as err:
        inject_distributed_sampler(loader, num_replicas=2, rank=0)
    assert "'self.sampler'" in str(err.value)
    assert "use_distributed_sampler=False" in str(err.value)


def test_batch_sampler_with_unsaved_argument_raises() -> None:
    class _Forgetful(BatchSampler):
        def __init__(self, sampler: Sampler[int], size: int) -> None:
            super().__init__(sampler, size, drop_last=False)

    dataset = _RangeDataset(4)
    loader = DataLoader(dataset, batch_sampler=_Forgetful(SequentialSampler(dataset), 2))
    match = r"cannot rebuild this batch sampler .* argument 'size' is not saved as the attribute 'self.size'"
    with pytest.raises(TypeError, match=match):
        inject_distributed_sampler(loader, num_replicas=2, rank=0)


def test_dataloader_subclass_is_rebuilt() -> None:
    loader = _LoaderWithExtra(_RangeDataset(10), "keep me", batch_size=5, shuffle=True, num_workers=1)
    new = inject_distributed_sampler(loader, num_replicas=2, rank=0)
    assert type(new) is _LoaderWithExtra
    assert new.extra == "keep me"
    assert (new.batch_size, new.num_workers) == (5, 1)
    assert type(new.sampler) is DistributedSampler
    assert new.sampler.shuffle


def test_dataloader_subclass_with_unsaved_required_argument_raises() -> None:
    loader = _LoaderForgetsArg(_RangeDataset(4), foo=1)
    expected = (
        "setup_dataloaders(_LoaderForgetsArg): cannot rebuild this DataLoader subclass with a distributed "
        "sampler because its __init__ argument 'foo' is not saved as the attribute 'self.foo'. Save it as "
        "'self.foo' in __init__, or pass use_distributed_sampler=False and give the loader a "
        "DistributedSampler yourself."
    )
    with pytest.raises(TypeError) as err:
        inject_distributed_sampler(loader, num_replicas=2, rank=0)
    assert str(err.value) == expected
    with pytest.raises(TypeError, match=r"^my_call\(_LoaderForgetsArg\): .*'foo'.*use_distributed_sampler"):
        inject_distributed_sampler(loader, num_replicas=2, rank=0, caller="my_call")


def test_dataloader_subclass_that_cannot_take_a_sampler_raises() -> None:
    loader = _LoaderWithoutSampler(_RangeDataset(4), batch_size=2)
    with pytest.raises(TypeError, match=r"takes neither a 'sampler' argument nor \*\*kwargs"):
        inject_distributed_sampler(loader, num_replicas=2, rank=0)


def test_dataloader_subclass_optional_argument_without_attribute_keeps_default() -> None:
    loader = _LoaderWithOptionalArg(_RangeDataset(4), mode="custom", batch_size=2)
    new = inject_distributed_sampler(loader, num_replicas=2, rank=0)
    assert type(new) is _LoaderWithOptionalArg
    assert new.seen_mode == "default"
    assert new.batch_size == 2


def test_loader_options_are_preserved() -> None:
    generator = torch.Generator().manual_seed(1)
    options: dict[str, Any] = {
        "batch_size": 3,
        "num_workers": 2,
        "collate_fn": _double,
        "pin_memory": True,
        "drop_last": True,
        "timeout": 5.0,
        "worker_init_fn": _noop_init,
        "multiprocessing_context": "spawn",
        "generator": generator,
        "prefetch_factor": 4,
        "persistent_workers": True,
    }
    if "in_order" in inspect.signature(DataLoader.__init__).parameters:
        options["in_order"] = False
    loader = DataLoader(_RangeDataset(10), shuffle=True, **options)
    new = inject_distributed_sampler(loader, num_replicas=2, rank=0)
    assert isinstance(new.sampler, DistributedSampler)
    for name in options:
        assert getattr(new, name) == getattr(loader, name), name
    assert new.generator is generator


def test_loader_without_automatic_batching_keeps_yielding_samples() -> None:
    loader = DataLoader(_RangeDataset(6), batch_size=None)
    new = inject_distributed_sampler(loader, num_replicas=2, rank=1)
    assert new.batch_size is None
    assert new.collate_fn is default_convert
    assert list(new) == [1, 3, 5]


def test_add_worker_init_fn_leaves_loaders_without_workers_or_with_their_own_alone() -> None:
    without_workers = DataLoader(_RangeDataset(4))
    assert add_worker_init_fn(without_workers, rank=0) is without_workers
    with_own = DataLoader(_RangeDataset(4), num_workers=2, worker_init_fn=_noop_init)
    assert add_worker_init_fn(with_own, rank=0) is with_own


def test_add_worker_init_fn_adds_seeded_function() -> None:
    dataset = _RangeDataset(10)
    loader = DataLoader(dataset, batch_size=2, shuffle=True, num_workers=2, collate_fn=_double)
    new = add_worker_init_fn(loader, rank=3)
    assert loader.worker_init_fn is None
    assert isinstance(new.worker_init_fn, functools.partial)
    assert new.worker_init_fn.func is worker_init_function
    assert new.worker_init_fn.keywords == {"rank": 3}
    assert new.sampler is loader.sampler
    assert (new.batch_size, new.num_workers, new.collate_fn) == (2, 2, _double)


def test_add_worker_init_fn_keeps_iterable_dataset_and_custom_batch_sampler() -> None:
    stream = add_worker_init_fn(DataLoader(_Stream(), batch_size=2, num_workers=1), rank=0)
    assert stream.worker_init_fn is not None
    assert stream.batch_size == 2
    dataset = _RangeDataset(4)
    batch_sampler = _TaggedBatchSampler(SequentialSampler(dataset), 2, False, "x")
    loader = DataLoader(dataset, batch_sampler=batch_sampler, num_workers=1)
    assert add_worker_init_fn(loader, rank=0).batch_sampler is batch_sampler


def test_add_worker_init_fn_rebuilds_subclass_that_takes_no_sampler() -> None:
    class _OwnSampling(DataLoader):
        def __init__(self, dataset: Dataset, num_workers: int, worker_init_fn: Any = None) -> None:
            super().__init__(dataset, 2, shuffle=True, num_workers=num_workers, worker_init_fn=worker_init_fn)

    new = add_worker_init_fn(_OwnSampling(_RangeDataset(4), num_workers=1), rank=0)
    assert type(new) is _OwnSampling
    assert isinstance(new.worker_init_fn, functools.partial)
    assert type(new.sampler) is RandomSampler


def test_add_worker_init_fn_subclass_with_unsaved_argument_raises() -> None:
    loader = _LoaderForgetsArg(_RangeDataset(4), foo=1, num_workers=1)
    match = r"setup_dataloaders\(_LoaderForgetsArg\): cannot rebuild .* to add a seeded worker_init_fn.*'foo'"
    with pytest.raises(TypeError, match=match):
        add_worker_init_fn(loader, rank=0)

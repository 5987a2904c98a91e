"""Tests for the DataLoader wrapper that setup_dataloaders returns."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Sampler

from fabric._dataloader import _FabricDataLoader


class _RecordingSampler(Sampler[int]):
    def __init__(self, n: int) -> None:
        self.n = n
        self.epochs: list[int] = []

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


def _dataset(n: int = 10) -> list[int]:
    return list(range(n))


def _tag(batch: Any, device: torch.device) -> tuple[str, Any, torch.device]:
    return "moved", batch, device


def test_set_epoch_is_called_on_the_sampler_each_epoch() -> None:
    sampler = _RecordingSampler(10)
    loader = _FabricDataLoader(DataLoader(_dataset(), batch_size=2, sampler=sampler))
    for expected in range(3):
        batches = list(loader)
        assert len(batches) == 5
        assert sampler.epochs == list(range(expected + 1))


def test_set_epoch_reaches_the_batch_samplers_sampler() -> None:
    sampler = _RecordingSampler(6)
    loader = _FabricDataLoader(DataLoader(_dataset(6), batch_sampler=BatchSampler(sampler, 3, False)))
    for _ in range(3):
        assert len(list(loader)) == 2
    assert sampler.epochs == [0, 1, 2]


def test_epoch_advances_when_iteration_starts() -> None:
    sampler = _RecordingSampler(4)
    loader = _FabricDataLoader(DataLoader(_dataset(4), sampler=sampler))
    iter(loader)
    assert sampler.epochs == [0]
    next(iter(loader))  # a partial epoch still counts
    iter(loader)
    assert sampler.epochs == [0, 1, 2]


def test_loader_without_set_epoch_iterates() -> None:
    loader = _FabricDataLoader(DataLoader(_dataset(4), batch_size=2))
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3]]


def test_batches_are_moved_with_move_fn() -> None:
    device = torch.device("cpu")
    loader = _FabricDataLoader(DataLoader(_dataset(4), batch_size=2), device=device, move_fn=_tag)
    batches = list(loader)
    assert [(tag, batch.tolist(), dev) for tag, batch, dev in batches] == [
        ("moved", [0, 1], device),
        ("moved", [2, 3], device),
    ]


def test_batches_are_yielded_as_is_without_device() -> None:
    calls: list[Any] = []
    loader = _FabricDataLoader(DataLoader(_dataset(4), batch_size=2), move_fn=lambda b, d: calls.append(b))
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3]]
    assert calls == []
    assert loader.device is None


def test_device_without_move_fn_raises() -> None:
    with pytest.raises(ValueError, match=r"device=cpu\): no move_fn was given.*Pass move_fn, or device=None"):
        _FabricDataLoader(DataLoader(_dataset()), device=torch.device("cpu"))


def test_attributes_pass_through_and_len() -> None:
    dataset = _dataset()
    original = DataLoader(dataset, batch_size=3, num_workers=0)
    device = torch.device("cpu")
    loader = _FabricDataLoader(original, device=device, move_fn=_tag)
    assert loader.dataloader is original
    assert loader.device == device
    assert loader.dataset is dataset
    assert loader.batch_size == 3
    assert loader.sampler is original.sampler
    assert len(loader) == len(original) == 4
    with pytest.raises(AttributeError, match="no_such_attribute"):
        _ = loader.no_such_attribute


def test_copy_and_pickle_do_not_recurse() -> None:
    loader = _FabricDataLoader(DataLoader(_dataset(), batch_size=5))
    for clone in (copy.copy(loader), pickle.loads(pickle.dumps(loader))):
        assert len(clone) == 2
        assert clone.batch_size == 5
    bare = _FabricDataLoader.__new__(_FabricDataLoader)
    with pytest.raises(AttributeError, match="dataset"):
        _ = bare.dataset

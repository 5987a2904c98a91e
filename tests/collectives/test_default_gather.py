"""The default fabric.all_gather/all_reduce: one collective per tensor, no shape exchange, no device-to-host sync."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.overrides import TorchFunctionMode

from fabric import _collectives
from fabric.utilities import distributed as fabric_dist
from fabric.utilities.direct_calls import DirectGroup

# What makes a CUDA or XLA tensor wait for its device (and, on XLA, run the pending graph) to hand values to Python.
_SYNCS = {Tensor.item, Tensor.tolist, Tensor.cpu, Tensor.numpy, Tensor.__bool__, Tensor.__int__, Tensor.__float__}


class _CountSyncs(TorchFunctionMode):
    """Counts every tensor method that would move values from the device to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _SYNCS:
            self.syncs.append(func.__name__)
        return func(*args, **(kwargs or {}))


class _TwoRankStrategy:
    """Rank 0 of 2: its all_gather stacks the tensor with a copy of itself, as the real one would."""

    global_rank, world_size, root_device = 0, 2, torch.device("cpu")

    def __init__(self) -> None:
        self.gathered: list[tuple[int, ...]] = []

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        self.gathered.append(tuple(tensor.shape))
        return torch.stack([tensor, tensor])

    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: str = "mean") -> Tensor:
        return tensor.clone()


@pytest.mark.parametrize("data", [torch.ones(3, 2), {"a": torch.ones(3), "b": [torch.zeros(2, 2), 1.0]}])
def test_default_all_gather_is_one_gather_per_tensor_without_a_sync(data: Any) -> None:
    strategy: Any = _TwoRankStrategy()
    with _CountSyncs() as counter:
        _collectives.all_gather(strategy, data, None, False)
    assert counter.syncs == [], "the default path must not wait for the device"
    expected = [(3, 2)] if isinstance(data, Tensor) else [(3,), (2, 2), ()]
    assert strategy.gathered == expected, "one gather per tensor, no shape header"


def test_uneven_opt_in_exchanges_shapes_first() -> None:
    strategy: Any = _TwoRankStrategy()
    with _CountSyncs() as counter:
        _collectives.all_gather(strategy, torch.ones(3), None, False, uneven=True)
    assert len(strategy.gathered) == 2, "the header, then the tensor"
    assert counter.syncs == ["tolist"], "the opt-in reads the shapes on the host (and the counter sees it)"


def test_default_all_reduce_of_a_tensor_skips_the_collection_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    def walked(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a single tensor needs no convert_to_tensors / apply_to_collection")

    monkeypatch.setattr(_collectives, "convert_to_tensors", walked)
    monkeypatch.setattr(_collectives, "apply_to_collection", walked)
    strategy: Any = _TwoRankStrategy()
    transposed = torch.ones(2, 3).t()
    assert _collectives.all_reduce(strategy, transposed, None, "sum").is_contiguous()
    assert _collectives.all_gather(strategy, transposed, None, False).shape == (2, 3, 2)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_strategy_gather_is_one_gather_into_a_preallocated_tensor(
    one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    real, real_direct = fabric_dist._gather_single, DirectGroup.gather_into

    def gather_single(out: Tensor, tensor: Tensor, group: Any = None) -> Any:
        calls.append((tuple(out.shape), tuple(tensor.shape)))
        return real(out, tensor, group=group)

    def gather_into(self: DirectGroup, out: Tensor, tensor: Tensor) -> None:
        calls.append((tuple(out.shape), tuple(tensor.shape)))
        real_direct(self, out, tensor)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("no list gather plus torch.stack")

    monkeypatch.setattr(fabric_dist, "_gather_single", gather_single)
    monkeypatch.setattr(DirectGroup, "gather_into", gather_into)
    monkeypatch.setattr(dist, "all_gather", refuse)
    monkeypatch.setattr(torch, "stack", refuse)
    x = torch.arange(6.0).view(2, 3)
    with _CountSyncs() as counter:
        gathered = fabric_dist.all_gather(x)
        scalar = fabric_dist.all_gather(torch.tensor(5.0))
    assert counter.syncs == []
    assert torch.equal(gathered, x.unsqueeze(0)) and torch.equal(scalar, torch.tensor([5.0]))
    assert calls == [((6,), (6,)), ((1,), (1,))]


def test_strategy_gather_with_sync_grads_stays_differentiable(one_rank_group: None) -> None:
    x = torch.ones(2, requires_grad=True)
    (fabric_dist.all_gather(x, sync_grads=True) * 3).sum().backward()
    assert torch.equal(x.grad, torch.full((2,), 3.0))


def test_all_reduce_leaves_the_input_and_parses_the_op_once(one_rank_group: None) -> None:
    x = torch.tensor([1, 2])
    assert torch.equal(fabric_dist.all_reduce(x, "mean"), torch.tensor([1.0, 2.0]))
    assert x.dtype == torch.int64 and torch.equal(x, torch.tensor([1, 2]))
    assert fabric_dist.parse_reduce_op("SUM") is fabric_dist.parse_reduce_op("SUM"), "parsed once per name"
    with pytest.raises(ValueError, match=r"all_reduce\(reduce_op='median'\): unknown reduction"):
        fabric_dist.parse_reduce_op("median")

"""The default gloo group's own methods, called directly: the same results as torch.distributed's functions."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fabric.utilities import direct_calls
from fabric.utilities import distributed as fabric_dist
from fabric.utilities.direct_calls import DirectGroup, direct_for, direct_group


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_gloo_default_group_is_called_directly_with_the_functions_results(one_rank_group: None) -> None:
    direct = direct_group()
    assert isinstance(direct, DirectGroup) and direct.size == 1
    assert direct_group() is direct, "built once per group"
    direct.barrier()
    x = torch.arange(6.0)
    reduced, expected = x.clone(), x.clone()
    direct.all_reduce(reduced, dist.ReduceOp.MAX)
    dist.all_reduce(expected, dist.ReduceOp.MAX)
    assert torch.equal(reduced, expected)
    out = torch.empty(6)
    direct.gather_into(out, x)
    assert torch.equal(out, x)


def test_fabric_collectives_go_direct_only_for_plain_real_tensors(
    one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    used: list[str] = []
    for name in ("all_reduce", "gather_into"):
        real = getattr(DirectGroup, name)
        monkeypatch.setattr(DirectGroup, name, lambda self, *a, _n=name, _r=real: (used.append(_n), _r(self, *a))[1])
    assert torch.equal(fabric_dist.all_reduce(torch.ones(3), "sum"), torch.ones(3))
    assert torch.equal(fabric_dist.all_gather(torch.ones(2)), torch.ones(1, 2))
    assert used == ["all_reduce", "gather_into"]
    used.clear()
    z = torch.tensor([1 + 2j, 3 - 1j])
    assert torch.equal(fabric_dist.all_reduce(z, "sum"), z), "complex: torch views it as real first"
    grad = fabric_dist.all_gather(torch.ones(2, requires_grad=True))
    assert torch.equal(grad, torch.ones(1, 2))
    assert fabric_dist.all_reduce(torch.ones(2), "sum", group=dist.group.WORLD).sum() == 2
    assert used == [], "complex, requires_grad and an explicit group take torch.distributed's functions"


def test_direct_calls_are_for_plain_real_tensors_outside_autograd_on_the_default_group(one_rank_group: None) -> None:
    assert direct_for(torch.ones(2), None) is direct_group() is not None
    assert direct_for(torch.nn.Parameter(torch.ones(2)), None) is None
    assert direct_for(torch.ones(2, dtype=torch.complex64), None) is None
    assert direct_for(torch.ones(2, requires_grad=True), None) is None
    assert direct_for(torch.ones(2), dist.group.WORLD) is None, "an explicit group takes torch's functions"


def test_the_cache_does_not_keep_a_destroyed_group_alive(one_rank_group: None) -> None:
    assert direct_group() is not None
    group = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    assert group() is None, "gloo's threads and the store connections must go with the group"
    assert direct_group() is None


def test_other_backends_and_older_process_groups_use_the_functions(monkeypatch: pytest.MonkeyPatch) -> None:
    class Group:
        def size(self) -> int:
            return 2

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert direct_calls._make(Group()) is None, "NCCL keeps torch's functions"
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert direct_calls._make(Group()) is None, "a mixed group dispatches by device"
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert direct_calls._make(Group()) is None, "a group without a flat gather method"

    class Gloo(Group):
        def _allgather_base(self, *args: Any) -> Any:  # torch before 2.13's name
            raise AssertionError("not called here")

    assert isinstance(direct_calls._make(Gloo()), DirectGroup)

"""The Collective classes within one process: SingleDeviceCollective, and TorchCollective's set-up and errors."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from fabric.collectives import SingleDeviceCollective, TorchCollective
from fabric.environments.default import find_free_port
from fabric.utilities.exceptions import FabricTypeError, FabricValueError


def test_single_device_collective_returns_what_one_process_contributes() -> None:
    one = SingleDeviceCollective()
    t = torch.arange(3.0)
    assert one.rank == 0 and one.world_size == 1
    assert one.broadcast(t, 0) is t and one.all_reduce(t, "sum") is t and one.reduce(t, 0, "sum") is t
    assert one.all_gather([], t) == [t] and one.gather(t, []) == [t]
    assert one.scatter(torch.zeros(3), [t]) is t and one.reduce_scatter(torch.zeros(3), [t]) is t
    assert one.all_to_all([], [t]) == [t] and one.recv(t, 0) is t
    one.send(t, 0)
    one.barrier()
    one.setup()
    assert one.create_group().group.size() == 1
    one.teardown()
    with pytest.raises(RuntimeError, match=r"owns no group yet. Call create_group\(\) first"):
        _ = one.group


@pytest.mark.usefixtures("no_cluster_env")
def test_torch_collective_creates_and_destroys_the_default_group_it_made() -> None:
    collective = TorchCollective().setup(
        main_address="127.0.0.1", main_port=find_free_port(), backend="gloo", rank=0, world_size=1
    )
    assert dist.is_initialized() and collective.rank == 0 and collective.world_size == 1
    assert "MASTER_PORT" not in os.environ  # the address it was given is not left behind
    assert collective.all_reduce(torch.tensor([2.0]), op="SUM").item() == 2.0
    assert collective.all_reduce(torch.tensor([2.0]), op=dist.ReduceOp.MAX).item() == 2.0
    assert TorchCollective().setup() is not None  # a second setup finds the group and leaves it alone
    collective.teardown()
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"neither created a group \(create_group\) nor the default group"):
        collective.teardown()


def test_torch_collective_rejects_unknown_reduce_ops() -> None:
    with pytest.raises(FabricValueError, match=r"op='mean' is not a torch.distributed.ReduceOp"):
        TorchCollective._convert_to_native_op("mean")
    with pytest.raises(FabricTypeError, match=r"op=3 is a int"):
        TorchCollective._convert_to_native_op(3)

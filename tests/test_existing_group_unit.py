"""ProcessGroupEnvironment: ranks from an existing torch.distributed group, which Fabric reuses and never destroys."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from fabric import Fabric
from fabric.environments import DETECTION_ORDER, ProcessGroupEnvironment, detect_environment

pytestmark = pytest.mark.usefixtures("no_cluster_env")


def _fake_group(monkeypatch: pytest.MonkeyPatch, world_size: int, rank: int) -> None:
    """Make torch.distributed report an initialised group without starting processes."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world_size)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)


def test_detected_first_and_only_when_a_group_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    assert DETECTION_ORDER[0] is ProcessGroupEnvironment
    assert not ProcessGroupEnvironment.detect()
    monkeypatch.setenv("RANK", "0")  # torchrun's variables lose to a group that already exists
    _fake_group(monkeypatch, 2, 0)
    assert isinstance(detect_environment(), ProcessGroupEnvironment)


def test_ranks_from_the_group_without_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_group(monkeypatch, 4, 3)
    env = ProcessGroupEnvironment()
    assert env.creates_processes_externally
    assert (env.world_size(), env.global_rank(), env.processes_per_node()) == (4, 3, 4)
    assert (env.local_rank(), env.node_rank()) == (3, 0)  # without LOCAL_WORLD_SIZE: one machine
    assert (env.main_address, env.main_port) == ("127.0.0.1", 0)  # not needed: the group exists


def test_ranks_use_local_variables_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_group(monkeypatch, 4, 3)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    env = ProcessGroupEnvironment()
    assert (env.processes_per_node(), env.local_rank(), env.node_rank()) == (2, 1, 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("NODE_RANK", "5")
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert (env.local_rank(), env.node_rank(), env.main_address, env.main_port) == (0, 5, "node0", 29500)


def test_auto_picks_ddp_over_the_existing_group(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_group(monkeypatch, 2, 1)
    fabric = Fabric(accelerator="cpu")
    assert type(fabric.strategy).__name__ == "DDPStrategy"
    assert isinstance(fabric.strategy.cluster_environment, ProcessGroupEnvironment)
    assert (fabric.world_size, fabric.global_rank, fabric.local_rank) == (2, 1, 1)
    assert fabric.strategy.launcher is None, "the processes exist; no launcher may start more"


def test_devices_that_contradict_the_group_are_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_group(monkeypatch, 2, 0)
    with pytest.raises(ValueError, match=r"Fabric\(devices=3, num_nodes=1\): torch.distributed is already initialised "
                       r"with world size 2, not 3 x 1\. Pass devices='auto'"):  # fmt: skip
        Fabric(accelerator="cpu", devices=3)


def test_fabric_reuses_a_real_group_and_leaves_it_alive() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.group.WORLD
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=1)
    fabric.launch()
    assert fabric.all_reduce(1.0, reduce_op="sum").item() == 1.0
    assert not fabric.strategy._owns_process_group
    fabric.strategy.teardown()
    assert dist.is_initialized() and dist.group.WORLD is group, "Fabric destroyed a group it did not create"

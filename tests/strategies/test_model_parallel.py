"""ModelParallelStrategy without extra processes: mesh sizes, data sharding by data-parallel rank, errors.

Training with tp=2 and dp=2 on two real processes is in tests/integration/test_model_parallel.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from fabric import Fabric
from fabric.strategies import ModelParallelStrategy

pytestmark = pytest.mark.usefixtures("no_cluster_env")


def _identity(module: nn.Module, mesh: Any) -> nn.Module:
    return module


def _strategy(devices: int = 2, num_nodes: int = 1, **kwargs: Any) -> ModelParallelStrategy:
    strategy = ModelParallelStrategy(_identity, **kwargs)
    Fabric(accelerator="cpu", strategy=strategy, devices=devices, num_nodes=num_nodes)
    return strategy


@pytest.mark.parametrize(
    ("kwargs", "num_nodes", "sizes"),
    [
        ({}, 1, (1, 2)),
        ({}, 2, (2, 2)),
        ({"data_parallel_size": 2}, 1, (2, 1)),
        ({"tensor_parallel_size": 1}, 2, (4, 1)),
        ({"data_parallel_size": 1, "tensor_parallel_size": 2}, 1, (1, 2)),
    ],
)
def test_auto_sizes_fill_the_world(kwargs: dict, num_nodes: int, sizes: tuple[int, int]) -> None:
    strategy = _strategy(num_nodes=num_nodes, **kwargs)
    assert (strategy.data_parallel_size, strategy.tensor_parallel_size) == sizes


@pytest.mark.parametrize(
    "kwargs",
    [{"data_parallel_size": 3}, {"tensor_parallel_size": 4}, {"data_parallel_size": 2, "tensor_parallel_size": 2}],
)
def test_sizes_that_do_not_multiply_to_the_world_size_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=r"the mesh must hold all 2 processes .* Choose sizes whose product is 2"):
        _strategy(**kwargs)


@pytest.mark.parametrize("size", [0, -1, "two", True])
def test_bad_size_values(size: Any) -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=.*expected 'auto' or an int >= 1"):
        ModelParallelStrategy(_identity, tensor_parallel_size=size)


def test_parallelize_fn_must_be_callable() -> None:
    with pytest.raises(TypeError, match=r"ModelParallelStrategy\(parallelize_fn=None\): expected a function"):
        ModelParallelStrategy(None)  # type: ignore[arg-type]


def test_tensor_parallel_ranks_of_one_replica_read_the_same_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    strategy = _strategy(data_parallel_size=1, tensor_parallel_size=2)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}
    dp2 = _strategy(devices=4, data_parallel_size=2, tensor_parallel_size=2)
    monkeypatch.setattr(type(dp2), "global_rank", property(lambda self: 3))
    assert dp2.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}
    loader = dp2.process_dataloader(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2))
    assert isinstance(loader.sampler, DistributedSampler)
    assert (loader.sampler.num_replicas, loader.sampler.rank) == (2, 1)


def test_parallelize_fn_must_return_a_module() -> None:
    strategy = ModelParallelStrategy(lambda module, mesh: None)  # type: ignore[arg-type, return-value]
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=1)
    fabric.launch()
    try:
        assert fabric.strategy.device_mesh.mesh_dim_names == ("data_parallel", "tensor_parallel")  # type: ignore[attr-defined]
        with pytest.raises(TypeError, match=r"parallelize_fn=<lambda>\) returned NoneType, not a module"):
            fabric.setup_module(nn.Linear(2, 2))
    finally:
        fabric.strategy.teardown()

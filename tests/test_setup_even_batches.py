"""fabric.setup_dataloaders(even_batches=...) in one process: the option's checks and what reaches the strategy.

Two real ranks reading exact shards are in tests/integration/test_exact_evaluation.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from fabric import Fabric
from fabric.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)
from fabric.utilities.exact_sampler import ExactDistributedSampler

pytestmark = pytest.mark.usefixtures("no_cluster_env")


def _loader(n: int = 7, **kwargs: Any) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(n)), batch_size=2, **kwargs)


def test_one_process_reads_every_sample_once() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    loader = fabric.setup_dataloaders(_loader(shuffle=True), even_batches=False)
    assert sorted(int(i) for (batch,) in loader for i in batch) == list(range(7))


def test_the_default_keeps_padding() -> None:
    strategy = DDPStrategy()
    Fabric(accelerator="cpu", strategy=strategy, devices=2)
    loader = strategy.process_dataloader(_loader())
    assert len(loader.sampler) == 4 and len(loader) == 2  # type: ignore[arg-type]


def test_ddp_shards_exactly_when_asked() -> None:
    strategy = DDPStrategy()
    Fabric(accelerator="cpu", strategy=strategy, devices=2)  # rank 0 of 2
    loader = strategy.process_dataloader(_loader(1), even_batches=False)
    assert isinstance(loader.sampler, ExactDistributedSampler) and len(loader) == 1


class _Stream(IterableDataset):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(3))


def test_iterable_dataset_is_refused_by_a_multi_process_strategy_too() -> None:
    strategy = DDPStrategy()
    Fabric(accelerator="cpu", strategy=strategy, devices=2)
    with pytest.raises(ValueError, match=r"setup_dataloaders\(even_batches=False\): the loader reads an IterableData"):
        strategy.process_dataloader(DataLoader(_Stream()), even_batches=False)


def test_iterable_dataset_is_refused_through_the_public_call() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    with pytest.raises(ValueError, match=r"IterableDataset \(_Stream\), which has no indices to deal out"):
        fabric.setup_dataloaders(DataLoader(_Stream()), even_batches=False)


def test_even_batches_false_needs_the_distributed_sampler() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    with pytest.raises(ValueError, match=r"use_distributed_sampler=False tells it not to shard at all"):
        fabric.setup_dataloaders(_loader(), use_distributed_sampler=False, even_batches=False)


def test_drop_last_is_refused() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    with pytest.raises(ValueError, match=r"drop_last=True, .* Build the loader with drop_last=False"):
        fabric.setup_dataloaders(_loader(drop_last=True), even_batches=False)


class _OldStyle(SingleDeviceStrategy):
    def process_dataloader(self, dataloader: DataLoader) -> DataLoader:  # type: ignore[override]
        return dataloader


def test_a_strategy_without_the_argument_is_told_what_to_add() -> None:
    fabric = Fabric(accelerator="cpu", strategy=_OldStyle(device=torch.device("cpu")))
    assert len(fabric.setup_dataloaders(_loader())) == 4, "the default call still works with the old signature"
    with pytest.raises(TypeError, match=r"_OldStyle.process_dataloader\(dataloader\) takes no even_batches argument"):
        fabric.setup_dataloaders(_loader(), even_batches=False)


@pytest.mark.parametrize(
    "strategy",
    [lambda: FSDPStrategy(), lambda: DeepSpeedStrategy(stage=3)],
    ids=["fsdp", "deepspeed_stage_3"],
)
def test_strategies_whose_forward_communicates_refuse_uneven_batches(strategy: Any) -> None:
    instance = strategy()
    Fabric(accelerator="cpu", strategy=instance, devices=2)
    with pytest.raises(ValueError, match=r"communicates in every forward pass .* Keep even_batches=True here"):
        instance.process_dataloader(_loader(), even_batches=False)
    assert len(instance.process_dataloader(_loader())) == 2, "even batches still work"


def test_deepspeed_stage_2_forward_does_not_communicate() -> None:
    instance = DeepSpeedStrategy(stage=2)
    Fabric(accelerator="cpu", strategy=instance, devices=2)
    assert isinstance(instance.process_dataloader(_loader(), even_batches=False).sampler, ExactDistributedSampler)


def test_model_parallel_refuses_only_when_replicas_read_different_data() -> None:
    def parallelize(module: Any, mesh: Any) -> Any:
        return module

    tensor_only = ModelParallelStrategy(parallelize, data_parallel_size=1, tensor_parallel_size=2)
    Fabric(accelerator="cpu", strategy=tensor_only, devices=2)
    loader = tensor_only.process_dataloader(_loader(), even_batches=False)
    assert len(loader.sampler) == 7, "one replica: both tensor-parallel ranks read every sample"  # type: ignore[arg-type]
    data_parallel = ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1)
    Fabric(accelerator="cpu", strategy=data_parallel, devices=2)
    with pytest.raises(ValueError, match=r"ModelParallelStrategy communicates in every forward pass"):
        data_parallel.process_dataloader(_loader(), even_batches=False)

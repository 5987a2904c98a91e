"""DataParallelStrategy ('dp'): one process; trains on one CPU device, becomes 'ddp' on several (as in Lightning)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric
from fabric.strategies import STRATEGY_REGISTRY, DataParallelStrategy, DDPStrategy

pytestmark = pytest.mark.usefixtures("no_cluster_env")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def test_dp_is_registered_and_needs_no_launch() -> None:
    assert "dp" in STRATEGY_REGISTRY
    fabric = Fabric(accelerator="cpu", devices=1, strategy="dp")
    strategy = fabric.strategy
    assert isinstance(strategy, DataParallelStrategy) and not strategy.requires_launch
    assert (strategy.global_rank, strategy.local_rank, strategy.node_rank, strategy.world_size) == (0, 0, 0, 1)
    assert fabric.device == torch.device("cpu")


def test_training_on_one_cpu_device_matches_plain_pytorch() -> None:
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 4, generator=generator), torch.randint(0, 2, (32,), generator=generator))
    fabric = Fabric(accelerator="cpu", devices=1, strategy="dp")
    user_model = _model()
    model, optimizer = fabric.setup(user_model, torch.optim.SGD(user_model.parameters(), lr=0.1))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=8))
    reference = _model()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    losses = []
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        losses.append(loss.item())
        ref_loss = nn.functional.cross_entropy(reference(x), y)
        ref_optimizer.zero_grad()
        ref_loss.backward()
        ref_optimizer.step()
        assert loss.item() == ref_loss.item()
    assert len(losses) == 4  # the one process reads every batch: no distributed sampler
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value)


def test_collectives_follow_lightnings_single_process_semantics() -> None:
    fabric = Fabric(accelerator="cpu", devices=1, strategy="dp")
    per_replica = torch.tensor([1.0, 2.0, 6.0])  # what DataParallel gathers from three replicas
    assert fabric.all_reduce(per_replica).item() == 3.0  # mean, as Lightning's DataParallelStrategy
    assert fabric.all_reduce(per_replica, reduce_op="sum").item() == 9.0
    assert fabric.all_reduce(per_replica, reduce_op="max").item() == 6.0
    assert fabric.all_reduce(torch.tensor([2, 4])).dtype == torch.int64
    assert torch.equal(fabric.all_gather(per_replica), per_replica)
    assert fabric.broadcast({"a": 1}) == {"a": 1}
    assert fabric.barrier() is None
    with pytest.raises(ValueError, match=r"all_reduce\(reduce_op='prod'\): unknown reduction"):
        fabric.all_reduce(per_replica, reduce_op="prod")


def test_several_cpu_devices_warn_and_use_ddp() -> None:
    # Lightning Fabric's fallback: DataParallel replicates over GPUs only, DDP runs one process per CPU device.
    message = (
        "Fabric(strategy='dp', accelerator='cpu', devices=2, num_nodes=1): DataParallel replicates the model over "
        "GPUs only, so fabric uses strategy='ddp' instead"
    )
    with pytest.warns(UserWarning, match=re.escape(message)):
        fabric = Fabric(accelerator="cpu", devices=2, strategy="dp")
    assert type(fabric.strategy) is DDPStrategy
    assert fabric.world_size == 2 and fabric.strategy.launcher is not None


def test_a_data_parallel_strategy_object_on_several_cpu_devices_is_refused() -> None:
    # Only the name falls back (as in Lightning); an object the user built is not replaced behind their back.
    with pytest.raises(ValueError, match=r"Fabric\(strategy='dp', accelerator='cpu', devices=2\): DataParallel "):
        Fabric(accelerator="cpu", devices=2, strategy=DataParallelStrategy())


def test_several_machines_are_refused() -> None:
    with pytest.raises(ValueError, match=r"Fabric\(strategy='dp', num_nodes=2\): DataParallel runs in one process"):
        # The object: the name 'dp' on the CPU becomes 'ddp', as above (with num_nodes=2 too, as in Lightning).
        Fabric(accelerator="cpu", devices=1, num_nodes=2, strategy=DataParallelStrategy())


def test_gpus_wrap_the_model_in_data_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    strategy = Fabric(accelerator="cuda", devices=[1, 3], strategy="dp").strategy
    assert strategy.root_device == torch.device("cuda", 1)
    assert strategy.parallel_devices == [torch.device("cuda", 1), torch.device("cuda", 3)]  # type: ignore[attr-defined]
    assert strategy.world_size == 1


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")
def test_one_gpu_trains_through_data_parallel() -> None:
    fabric = Fabric(accelerator="cuda", devices=1, strategy="dp")
    user_model = _model()
    model, optimizer = fabric.setup(user_model, torch.optim.SGD(user_model.parameters(), lr=0.1))
    assert isinstance(model._forward_module, nn.DataParallel)
    x, y = torch.randn(8, 4, device=fabric.device), torch.randint(0, 2, (8,), device=fabric.device)
    losses = []
    for _ in range(3):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert set(model.state_dict()) == set(_model().state_dict())  # no DataParallel 'module.' prefix


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpus_split_the_batch() -> None:
    fabric = Fabric(accelerator="cuda", devices=2, strategy="dp")
    model = fabric.setup(_model())
    assert isinstance(model._forward_module, nn.DataParallel)
    devices = set()
    model.module.register_forward_hook(lambda m, i, o: devices.add(o.device))
    model(torch.randn(8, 4, device=fabric.device))
    assert devices == {torch.device("cuda", 0), torch.device("cuda", 1)}

"""DDPShardedStrategy (fairscale) in one process: registry, import, options, errors, setup and training on 1 rank.

Two real ranks against DDP: tests/integration/test_fairscale.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.precision import MixedPrecision
from fabric.strategies import STRATEGY_REGISTRY
from fabric.strategies.launchers.multiprocessing import MultiProcessingLauncher
from fabric.strategies.launchers.subprocess_script import SubprocessScriptLauncher
from fabric.utilities.exceptions import FabricTypeError, FabricValueError

pytest.importorskip("fairscale", reason='fairscale is not installed (pip install "torchfabric[fairscale]")')

from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS

from fabric.strategies.fairscale import DDPShardedStrategy
from fabric.strategies.fairscale import strategy as strategy_module


def _escaped(text: str) -> str:
    return re.escape(text)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _one_rank(**kwargs: Any) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=DDPShardedStrategy(**kwargs))
    fabric.launch()
    return fabric


def _step(fabric: Fabric, model: Any, optimizer: Any) -> torch.Tensor:
    optimizer.zero_grad()
    loss = model(torch.ones(3, 4, device=fabric.device)).sum()
    fabric.backward(loss)
    optimizer.step()
    return loss


def test_lightning_names_pick_the_launcher(no_cluster_env: None) -> None:
    for name, launcher, method in (
        ("ddp_sharded", SubprocessScriptLauncher, None),
        ("ddp_sharded_spawn", MultiProcessingLauncher, "spawn"),
    ):
        strategy = Fabric(accelerator="cpu", devices=2, strategy=name).strategy
        assert isinstance(strategy, DDPShardedStrategy)
        assert strategy.requires_joint_setup
        assert isinstance(strategy.launcher, launcher)
        assert getattr(strategy.launcher, "start_method", None) == method
    assert STRATEGY_REGISTRY.factory_of("ddp_sharded") is DDPShardedStrategy


def test_lightning_1_9_import_paths() -> None:
    from fabric.strategies import DDPShardedStrategy as from_package
    from fabric.strategies.fairscale import DDPShardedStrategy as from_family

    assert from_package is from_family is DDPShardedStrategy


def test_import_fabric_does_not_import_fairscale() -> None:
    code = (
        "import sys\nimport fabric\nfrom fabric import Fabric\nFabric(accelerator='cpu', strategy='ddp', devices=2)\n"
    )
    code += "print('fairscale' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_missing_fairscale_names_the_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fairscale", None)  # what `import fairscale` sees when it is not installed
    with pytest.raises(ModuleNotFoundError, match=_escaped('Install it with pip install "torchfabric[fairscale]"')):
        Fabric(accelerator="cpu", devices=2, strategy="ddp_sharded")


def test_ddp_only_options_are_refused_with_the_accepted_ones() -> None:
    with pytest.raises(FabricTypeError, match=_escaped("DDPShardedStrategy(find_unused_parameters=...): fairscale's")):
        DDPShardedStrategy(find_unused_parameters=True)
    with pytest.raises(FabricTypeError, match="It accepts: broadcast_buffers, sync_models_at_startup, reduce_buffer"):
        DDPShardedStrategy(gradient_as_bucket_view=True)
    with pytest.raises(FabricValueError, match=_escaped("DDPShardedStrategy(process_group=...): the sharded optim")):
        DDPShardedStrategy(process_group=None)


def test_fairscale_fsdp_by_its_lightning_name_explains_what_to_use() -> None:
    with pytest.raises(FabricValueError, match=_escaped("Fabric(strategy='ddp_fully_sharded'): fairscale's Fully")):
        Fabric(accelerator="cpu", devices=2, strategy="ddp_fully_sharded")
    with pytest.raises(FabricValueError, match=_escaped("it needs CUDA streams. Use strategy='fsdp'")):
        Fabric(accelerator="cpu", devices=2, strategy="ddp_fully_sharded")


def test_a_plain_grad_scaler_is_refused(no_cluster_env: None) -> None:
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(FabricTypeError, match=_escaped("plugins=[MixedPrecision(scaler=GradScaler)]): each rank")):
        Fabric(accelerator="cpu", devices=2, strategy="ddp_sharded", plugins=[plugin])


def test_a_sharded_grad_scaler_is_accepted(no_cluster_env: None) -> None:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    plugin = MixedPrecision("16-mixed", "cpu", scaler=ShardedGradScaler("cpu"))
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp_sharded", plugins=[plugin])
    assert fabric.strategy.precision is plugin


def test_16_mixed_on_a_gpu_scales_with_a_sharded_scaler() -> None:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    strategy = DDPShardedStrategy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the scaler warns that CUDA is missing on this machine, and disables itself
        plugin = strategy._precision_plugin("16-mixed", "cuda")
    assert isinstance(plugin, MixedPrecision) and isinstance(plugin.scaler, ShardedGradScaler)
    assert strategy._precision_plugin("bf16-mixed", "cuda") is None
    assert strategy._precision_plugin("16-mixed", "cpu") is None  # the connector turns it into bf16-mixed


def test_warns_once_that_fairscale_is_unmaintained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(strategy_module, "_warnings", type(strategy_module._warnings)())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DDPShardedStrategy()
        DDPShardedStrategy(start_method="spawn")
    messages = [str(w.message) for w in caught if "no longer maintained" in str(w.message)]
    assert len(messages) == 1
    assert "use strategy='fsdp'" in messages[0]


def test_setup_optimizer_alone_explains_the_joint_call() -> None:
    with pytest.raises(RuntimeError, match=_escaped("Call model, optimizer = fabric.setup(model, optimizer).")):
        DDPShardedStrategy().setup_optimizer(torch.optim.SGD(_model().parameters(), lr=0.1))


def test_one_rank_trains_with_oss_and_sharded_ddp(no_cluster_env: None) -> None:
    fabric = _one_rank(broadcast_buffers=False)
    model = _model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert isinstance(model._forward_module, ShardedDataParallel)
    assert isinstance(optimizer.optimizer, OSS)
    assert isinstance(optimizer.optimizer.optim, torch.optim.SGD)  # the shard's optimizer is the user's class
    assert not model._forward_module._enable_broadcast_buffers  # keyword arguments reach ShardedDataParallel
    reference = _model()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        _step(fabric, model, optimizer)
        reference_optimizer.zero_grad()
        reference(torch.ones(3, 4)).sum().backward()
        reference_optimizer.step()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    with fabric.no_backward_sync(model):
        fabric.backward(model(torch.ones(1, 4)).sum())
    fabric.clip_gradients(model, optimizer, clip_val=1e-3)  # by value: each rank clamps what it owns
    assert all(p.grad.abs().max() <= 1e-3 for p in model.parameters())


def test_a_users_oss_is_used_as_it_is(no_cluster_env: None) -> None:
    fabric = _one_rank()
    model = _model()
    oss = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    model, optimizer = fabric.setup(model, oss)
    assert optimizer.optimizer is oss
    _step(fabric, model, optimizer)
    assert len(oss.optim.state) == 4


def test_optimizer_state_from_before_setup_is_kept(no_cluster_env: None) -> None:
    fabric = _one_rank()
    model = _model()
    plain = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(1, 4)).sum().backward()
    plain.step()  # e.g. a resumed run that loaded the optimizer before fabric.setup
    before = {k: v.clone() for k, v in plain.state[next(model.parameters())].items()}
    _, optimizer = fabric.setup(model, plain)
    after = optimizer.optimizer.optim.state[next(model.parameters())]
    assert all(torch.equal(after[k], v) for k, v in before.items())


class _NeedsWarmup(torch.optim.SGD):
    """An optimizer whose constructor takes an argument it does not keep in its defaults."""

    def __init__(self, params: Any, warmup: int, lr: float = 0.1) -> None:
        super().__init__(params, lr=lr)
        self.warmup = warmup


def test_an_optimizer_oss_cannot_rebuild_names_the_fix(no_cluster_env: None) -> None:
    fabric = _one_rank()
    model = _model()
    with pytest.raises(FabricTypeError, match=_escaped("fabric.setup(model, _NeedsWarmup): fairscale's OSS rebuilds")):
        fabric.setup(model, _NeedsWarmup(model.parameters(), warmup=3))
    with pytest.raises(FabricTypeError, match=_escaped("pass it: OSS(model.parameters(), optim=_NeedsWarmup, ...)")):
        fabric.setup(model, _NeedsWarmup(model.parameters(), warmup=3))


def test_no_backward_sync_needs_the_set_up_model(no_cluster_env: None) -> None:
    fabric = _one_rank()
    with pytest.raises(FabricTypeError, match=_escaped("no_backward_sync(Sequential): gradient sync can only be")):
        fabric.strategy.no_backward_sync(_model(), True)
    assert fabric.strategy.no_backward_sync(_model(), False).__enter__() is None


def test_reduce_buffer_size_defaults_to_lightnings(no_cluster_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import fairscale.nn.data_parallel as data_parallel

    seen: list[int] = []

    class Recording(ShardedDataParallel):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            seen.append(kwargs["reduce_buffer_size"])
            super().__init__(*args, **kwargs)

    fabric = _one_rank()
    strategy = _one_rank(reduce_buffer_size=123).strategy
    monkeypatch.setattr(data_parallel, "ShardedDataParallel", Recording)
    for num_nodes, expected in ((1, 0), (2, 2**23)):
        fabric.strategy.num_nodes = num_nodes  # only the default changes; this group still has one process
        model = _model()
        fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        assert seen[-1] == expected
    model = _model()
    strategy.setup_module_and_optimizers(model, [torch.optim.SGD(model.parameters(), lr=0.1)])
    assert seen[-1] == 123


def test_gathered_optimizer_state_is_not_kept_by_oss(no_cluster_env: None, tmp_path: Any) -> None:
    fabric = _one_rank()
    model = _model()
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    _step(fabric, model, optimizer)
    state = optimizer.state_dict()
    assert [entry["step"].item() for entry in state["state"].values()] == [1.0] * 4
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer})
    assert optimizer.optimizer._all_states == []  # the consolidated copies went with the returned dicts
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)["optimizer"]
    assert saved["param_groups"] == state["param_groups"]
    assert all(torch.equal(saved["state"][i]["exp_avg"], state["state"][i]["exp_avg"]) for i in range(4))


@pytest.mark.cuda
def test_16_mixed_on_one_gpu_trains_with_the_sharded_scaler(no_cluster_env: None) -> None:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    fabric = Fabric(accelerator="cuda", devices=1, strategy="ddp_sharded", precision="16-mixed")
    fabric.launch()
    assert isinstance(fabric.strategy.precision.scaler, ShardedGradScaler)
    model = _model()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):
        _step(fabric, model, optimizer)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_the_spawn_strategy_pickles_into_its_processes(no_cluster_env: None) -> None:
    import pickle

    strategy = Fabric(accelerator="cpu", devices=2, strategy="ddp_sharded_spawn").strategy
    copy = pickle.loads(pickle.dumps(strategy))
    assert isinstance(copy, DDPShardedStrategy) and copy.world_size == 2

"""Tests for the Fabric API in one process on the CPU: setup, launch, steps, collectives, checkpoints, logging."""

from __future__ import annotations

import copy
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import CPUAccelerator, Fabric, Precision, SingleDeviceStrategy
from fabric._dataloader import _FabricDataLoader
from fabric.loggers.logger import Logger
from fabric.wrappers import _FabricModule, _FabricOptimizer

_CLUSTER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*_CLUSTER_VARS, "MASTER_ADDR", "MASTER_PORT", "FABRIC_GLOBAL_SEED", "FABRIC_SEED_WORKERS"):
        monkeypatch.delenv(name, raising=False)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _fabric(**kwargs: Any) -> Fabric:
    return Fabric(accelerator="cpu", **kwargs)


def _setup(fabric: Fabric, lr: float = 0.1) -> tuple[Any, Any]:
    model = _model()
    return fabric.setup(model, torch.optim.SGD(model.parameters(), lr=lr))


# -- properties -------------------------------------------------------------------------------------------
def test_properties_on_a_single_cpu() -> None:
    fabric = _fabric()
    assert fabric.device == torch.device("cpu")
    assert fabric.global_rank == 0
    assert fabric.local_rank == 0
    assert fabric.node_rank == 0
    assert fabric.world_size == 1
    assert fabric.is_global_zero
    assert isinstance(fabric.strategy, SingleDeviceStrategy)
    assert isinstance(fabric.accelerator, CPUAccelerator)
    assert fabric.loggers == []


# -- setup ------------------------------------------------------------------------------------------------
def test_setup_returns_wrapped_model_and_optimizers() -> None:
    fabric = _fabric()
    model = _model()
    opt_a = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt_b = torch.optim.Adam(model[2].parameters())
    wrapped, wrapped_a, wrapped_b = fabric.setup(model, opt_a, opt_b)
    assert isinstance(wrapped, _FabricModule)
    assert wrapped.module is model
    assert isinstance(wrapped_a, _FabricOptimizer) and isinstance(wrapped_a, torch.optim.SGD)
    assert isinstance(wrapped_b, _FabricOptimizer) and isinstance(wrapped_b, torch.optim.Adam)
    assert wrapped_a.optimizer is opt_a
    assert wrapped_b.optimizer is opt_b


def test_setup_with_only_a_model_returns_the_model() -> None:
    fabric = _fabric()
    wrapped = fabric.setup(_model())
    assert isinstance(wrapped, _FabricModule)


def test_setup_converts_the_model_to_the_precision() -> None:
    fabric = _fabric(precision="64-true")
    wrapped = fabric.setup(_model())
    assert all(p.dtype == torch.float64 for p in wrapped.parameters())
    out = wrapped(torch.randn(2, 4))  # float32 input is converted, output is back in the default dtype
    assert out.dtype == torch.float32


def test_a_training_step_changes_the_weights() -> None:
    fabric = _fabric()
    model, optimizer = _setup(fabric)
    before = copy.deepcopy(model.state_dict())
    loss = model(torch.randn(8, 4)).pow(2).sum()
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    after = model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_setup_twice_with_the_same_model_is_refused() -> None:
    fabric = _fabric()
    model = fabric.setup(_model())
    with pytest.raises(ValueError, match=r"fabric.setup\(_FabricModule\): this object was already set up by fabric"):
        fabric.setup(model)


def test_setup_twice_with_the_same_optimizer_is_refused() -> None:
    fabric = _fabric()
    _, optimizer = _setup(fabric)
    with pytest.raises(ValueError, match=r"fabric.setup\(FabricSGD\): this object was already set up"):
        fabric.setup(_model(), optimizer)


def test_setup_module_then_setup_optimizers() -> None:
    fabric = _fabric()
    model = fabric.setup_module(_model())
    assert isinstance(model, _FabricModule)
    opt_a = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = fabric.setup_optimizers(opt_a)
    assert isinstance(optimizer, _FabricOptimizer)
    assert optimizer.optimizer is opt_a
    opt_b = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(model.parameters(), lr=0.2)
    both = fabric.setup_optimizers(opt_b, opt_c)
    assert isinstance(both, tuple) and [o.optimizer for o in both] == [opt_b, opt_c]


def test_setup_module_twice_is_refused() -> None:
    fabric = _fabric()
    model = fabric.setup_module(_model())
    with pytest.raises(ValueError, match=r"fabric.setup_module\(_FabricModule\): this object was already set up"):
        fabric.setup_module(model)


def test_setup_optimizers_twice_is_refused() -> None:
    fabric = _fabric()
    model = fabric.setup_module(_model())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"fabric.setup_optimizers\(FabricSGD\): this object was already set up"):
        fabric.setup_optimizers(optimizer)


def test_setup_optimizers_without_optimizers() -> None:
    with pytest.raises(TypeError, match=r"fabric.setup_optimizers\(\): no optimizer was passed"):
        _fabric().setup_optimizers()


# -- dataloaders ------------------------------------------------------------------------------------------
def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(10.0).unsqueeze(1)), batch_size=4)


def test_setup_dataloaders_wraps_and_keeps_all_data() -> None:
    fabric = _fabric()
    loader = fabric.setup_dataloaders(_loader())
    assert isinstance(loader, _FabricDataLoader)
    values = torch.cat([batch[0] for batch in loader]).flatten().tolist()
    assert values == [float(i) for i in range(10)]


def test_setup_dataloaders_with_several_returns_a_list() -> None:
    loaders = _fabric().setup_dataloaders(_loader(), _loader())
    assert isinstance(loaders, list) and len(loaders) == 2
    assert all(isinstance(loader, _FabricDataLoader) for loader in loaders)


def test_setup_dataloaders_rejects_other_objects() -> None:
    with pytest.raises(TypeError, match=r"fabric.setup_dataloaders\(list\): expected a torch.utils.data.DataLoader"):
        _fabric().setup_dataloaders([1, 2, 3])  # type: ignore[arg-type]


def test_setup_dataloaders_twice_is_refused() -> None:
    fabric = _fabric()
    loader = fabric.setup_dataloaders(_loader())
    with pytest.raises(ValueError, match=r"fabric.setup_dataloaders\(\): this DataLoader was already set up"):
        fabric.setup_dataloaders(loader)


def test_setup_dataloaders_without_loaders() -> None:
    with pytest.raises(TypeError, match=r"fabric.setup_dataloaders\(\): no DataLoader was passed"):
        _fabric().setup_dataloaders()


# -- launch -----------------------------------------------------------------------------------------------
def test_launch_runs_the_function_and_returns_its_result() -> None:
    fabric = _fabric()
    seen: list[Fabric] = []

    def train(fab: Fabric, x: int, scale: int = 1) -> int:
        seen.append(fab)
        return x * scale

    assert fabric.launch(train, 3, scale=5) == 15
    assert seen == [fabric]


def test_launch_without_a_function_returns_none() -> None:
    assert _fabric().launch() is None


def test_launch_with_a_function_that_takes_no_fabric() -> None:
    def train() -> None:
        pass

    with pytest.raises(TypeError, match=r"fabric.launch\(train\): train\(\) must take the Fabric object as its first"):
        _fabric().launch(train)


def test_launch_with_something_not_callable() -> None:
    with pytest.raises(TypeError, match=r"fabric.launch\(42\): expected a function"):
        _fabric().launch(42)  # type: ignore[arg-type]


def test_launch_twice_is_refused() -> None:
    fabric = _fabric()
    fabric.launch()
    with pytest.raises(RuntimeError, match=r"fabric.launch\(\): launch was already called for this Fabric object"):
        fabric.launch()


def test_launch_after_setup_on_a_single_device() -> None:
    fabric = _fabric()
    fabric.setup(_model())
    assert fabric.launch(lambda fab: 7) == 7


def test_ddp_used_before_launch_is_refused() -> None:
    fabric = _fabric(strategy="ddp", devices=2)
    with pytest.raises(RuntimeError, match=r"fabric.setup\(\) was called before fabric.launch\(\), so the 2 processes"):
        fabric.setup(_model())
    with pytest.raises(RuntimeError, match=r"fabric.setup_dataloaders\(\) was called before fabric.launch\(\)"):
        fabric.setup_dataloaders(_loader())
    with pytest.raises(RuntimeError, match=r"fabric.barrier\(\) was called before fabric.launch\(\)"):
        fabric.barrier()


def test_ddp_spawn_launch_without_a_function() -> None:
    fabric = _fabric(strategy="ddp_spawn", devices=2)
    with pytest.raises(TypeError, match=r"fabric.launch\(\): strategy DDPStrategy starts new processes that run a"):
        fabric.launch()


# -- gradients ----------------------------------------------------------------------------------------------
def _with_gradients(fabric: Fabric) -> tuple[Any, Any, nn.Module]:
    torch.manual_seed(0)
    model, optimizer = _setup(fabric)
    reference = copy.deepcopy(model.module)
    x = torch.randn(16, 4)
    fabric.backward(model(x).pow(2).sum() * 10)
    reference(x).pow(2).sum().mul(10).backward()
    return model, optimizer, reference


def test_clip_gradients_by_norm() -> None:
    fabric = _fabric()
    model, optimizer, reference = _with_gradients(fabric)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)
    norm = fabric.clip_gradients(model, optimizer, max_norm=0.5)
    assert norm is not None
    assert torch.allclose(norm, expected)
    assert norm > 0.5
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(ours.grad, theirs.grad)
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert total == pytest.approx(0.5, rel=1e-4)


def test_clip_gradients_by_value() -> None:
    fabric = _fabric()
    model, optimizer, _ = _with_gradients(fabric)
    assert max(p.grad.abs().max().item() for p in model.parameters()) > 0.01
    assert fabric.clip_gradients(model, optimizer, clip_val=0.01) is None
    assert max(p.grad.abs().max().item() for p in model.parameters()) <= 0.01


@pytest.mark.parametrize("kwargs", [{}, {"clip_val": 1.0, "max_norm": 1.0}])
def test_clip_gradients_needs_exactly_one_limit(kwargs: dict[str, float]) -> None:
    fabric = _fabric()
    model, optimizer = _setup(fabric)
    with pytest.raises(ValueError, match=r"fabric.clip_gradients\(clip_val=.*, max_norm=.*\): pass exactly one"):
        fabric.clip_gradients(model, optimizer, **kwargs)


def test_no_backward_sync_on_a_single_device_is_a_plain_context() -> None:
    fabric = _fabric()
    model, _ = _setup(fabric)
    with fabric.no_backward_sync(model):
        fabric.backward(model(torch.randn(2, 4)).sum())
    assert all(p.grad is not None for p in model.parameters())


def test_no_backward_sync_needs_the_wrapped_model() -> None:
    with pytest.raises(TypeError, match=r"fabric.no_backward_sync\(Sequential\): expected the model returned by"):
        _fabric().no_backward_sync(_model())  # type: ignore[arg-type]


def test_backward_guard_through_a_precision_plugin() -> None:
    class _NeedsFabricBackward(Precision):
        @property
        def requires_fabric_backward(self) -> bool:
            return True

    fabric = _fabric(plugins=[_NeedsFabricBackward()])
    model, _ = _setup(fabric)
    with pytest.raises(RuntimeError, match=r"Call fabric.backward\(loss\) instead"):
        model(torch.randn(2, 4)).sum().backward()
    fabric.backward(model(torch.randn(2, 4)).sum())
    assert all(p.grad is not None for p in model.parameters())


def test_autocast_uses_the_precision() -> None:
    fabric = _fabric(precision="bf16-mixed")
    with fabric.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


# -- devices and initialisation -----------------------------------------------------------------------------
def test_to_device() -> None:
    fabric = _fabric()
    module = nn.Linear(2, 2)
    assert fabric.to_device(module) is module
    batch = fabric.to_device({"x": torch.ones(2), "y": [torch.zeros(1)], "n": 1})
    assert batch["x"].device == fabric.device
    assert batch["y"][0].device == fabric.device
    assert batch["n"] == 1


class _FivesLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(32, 32))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.constant_(self.weight, 5.0)


def test_init_module_runs_initialisation_by_default() -> None:
    fabric = _fabric()
    with fabric.init_module():
        module = _FivesLinear()
    assert module.weight.device == fabric.device
    assert torch.equal(module.weight, torch.full((32, 32), 5.0))


def test_init_module_with_empty_init_skips_initialisation() -> None:
    fabric = _fabric()
    with fabric.init_module(empty_init=True):
        module = _FivesLinear()
    assert module.weight.device == fabric.device
    assert not torch.equal(module.weight, torch.full((32, 32), 5.0))
    assert torch.equal(module.weight, torch.zeros(32, 32))  # only the init call was skipped
    torch.nn.init.constant_(module.weight, 1.0)  # and init works again after the block
    assert torch.equal(module.weight, torch.ones(32, 32))


def test_init_module_uses_the_precision_dtype() -> None:
    fabric = _fabric(precision="bf16-true")
    with fabric.init_module():
        layer = nn.Linear(2, 2)
    assert layer.weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32


def test_init_tensor_under_64_true() -> None:
    fabric = _fabric(precision="64-true")
    with fabric.init_tensor():
        tensor = torch.randn(3)
        assert torch.get_default_dtype() == torch.float64
    assert tensor.dtype == torch.float64
    assert tensor.device == fabric.device
    assert torch.get_default_dtype() == torch.float32
    assert torch.randn(1).dtype == torch.float32


# -- collectives on one process -------------------------------------------------------------------------------
def test_all_gather_converts_numbers_to_tensors() -> None:
    fabric = _fabric()
    gathered = fabric.all_gather({"a": 3, "b": [torch.tensor([1.0, 2.0])]})
    assert isinstance(gathered["a"], torch.Tensor)
    assert gathered["a"].item() == 3
    assert torch.equal(gathered["b"][0], torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("op", ["mean", "sum", "max", "min"])
def test_all_reduce_on_one_process_is_the_value(op: str) -> None:
    reduced = _fabric().all_reduce({"loss": 2.5, "t": torch.tensor([1.0, 3.0])}, reduce_op=op)
    assert isinstance(reduced["loss"], torch.Tensor)
    assert reduced["loss"].item() == 2.5
    assert torch.equal(reduced["t"], torch.tensor([1.0, 3.0]))


def test_all_reduce_with_an_unknown_op() -> None:
    with pytest.raises(ValueError, match=r"all_reduce\(reduce_op='median'\): unknown reduction. Use one of"):
        _fabric().all_reduce(torch.tensor(1.0), reduce_op="median")


def test_broadcast_and_barrier_on_one_process() -> None:
    fabric = _fabric()
    payload = {"config": [1, 2]}
    assert fabric.broadcast(payload) is payload
    fabric.barrier("sync")  # nobody to wait for: returns at once
    assert fabric.broadcast(5, src=0) == 5


def test_rank_zero_first_runs_the_block() -> None:
    fabric = _fabric()
    ran: list[bool] = []
    with fabric.rank_zero_first():
        ran.append(True)
    with fabric.rank_zero_first(local=True):
        ran.append(True)
    assert ran == [True, True]


def test_print_on_rank_zero(capsys: pytest.CaptureFixture[str]) -> None:
    _fabric().print("hello", 3, sep="-")
    assert capsys.readouterr().out == "hello-3\n"


# -- callbacks and logging ---------------------------------------------------------------------------------------
class _Callback:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def on_train_start(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append((args, kwargs))


class _FakeLogger(Logger):
    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, Any], int | None]] = []

    @property
    def name(self) -> str:
        return "fake"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        self.logged.append((dict(metrics), step))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def test_call_invokes_callbacks_that_have_the_hook() -> None:
    first, second = _Callback(), _Callback()
    without = object()
    fabric = _fabric(callbacks=[first, without, second])
    fabric.call("on_train_start", 1, key="v")
    fabric.call("on_unknown_hook", 2)
    assert first.calls == [((1,), {"key": "v"})]
    assert second.calls == [((1,), {"key": "v"})]


def test_a_single_callback_need_not_be_in_a_list() -> None:
    callback = _Callback()
    _fabric(callbacks=callback).call("on_train_start")
    assert callback.calls == [((), {})]


def test_log_and_log_dict_reach_every_logger_as_numbers() -> None:
    first, second = _FakeLogger(), _FakeLogger()
    fabric = _fabric(loggers=[first, second])
    fabric.log("loss", torch.tensor(0.5), step=3)
    fabric.log_dict({"acc": torch.tensor(0.25), "epoch": 1})
    expected = [({"loss": 0.5}, 3), ({"acc": 0.25, "epoch": 1}, None)]
    assert first.logged == expected
    assert second.logged == expected
    assert type(first.logged[0][0]["loss"]) is float
    assert fabric.logger is first
    assert fabric.loggers == [first, second]


def test_logging_a_tensor_of_several_values_names_it() -> None:
    fabric = _fabric(loggers=[_FakeLogger()])
    with pytest.raises(
        ValueError,
        match=r"fabric.log\('acc', tensor of shape \[3\]\): a metric must be one number, "
        r"but this tensor holds 3 values. Reduce it first",
    ):
        fabric.log("acc", torch.ones(3))


def test_every_public_name_imports_from_the_package() -> None:
    import fabric as package

    missing = [name for name in package.__all__ if not hasattr(package, name)]
    assert missing == [], f"fabric.__all__ lists names the package does not define: {missing}"


def test_logger_without_loggers() -> None:
    fabric = _fabric()
    with pytest.raises(RuntimeError, match=r"fabric.logger: no logger was configured. Pass loggers="):
        _ = fabric.logger
    fabric.log("loss", 1.0)  # logging without loggers is a no-op, not an error
    assert fabric.loggers == []


# -- checkpoints ------------------------------------------------------------------------------------------------
def _train_one_step(fabric: Fabric, model: Any, optimizer: Any) -> None:
    fabric.backward(model(torch.randn(4, 4)).sum())
    optimizer.step()
    optimizer.zero_grad()


def _adam_setup(fabric: Fabric) -> tuple[Any, Any]:
    model = _model()
    return fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    fabric = _fabric()
    model, optimizer = _adam_setup(fabric)
    _train_one_step(fabric, model, optimizer)
    path = tmp_path / "ckpt.pt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 5, "extra": "kept"})
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(optimizer.state_dict())

    torch.manual_seed(123)
    fresh_model, fresh_opt = _adam_setup(fabric)
    state = {"model": fresh_model, "optimizer": fresh_opt, "step": 0}
    remainder = fabric.load(path, state)

    assert remainder == {"extra": "kept"}
    assert state["step"] == 5
    assert state["model"] is fresh_model  # restored in place
    for key, value in saved_model.items():
        assert torch.equal(fresh_model.state_dict()[key], value)
    loaded_opt = fresh_opt.optimizer.state_dict()
    assert loaded_opt["param_groups"] == saved_opt["param_groups"]
    for index, entry in saved_opt["state"].items():
        assert torch.equal(loaded_opt["state"][index]["exp_avg"], entry["exp_avg"])


def test_saved_checkpoint_holds_plain_state_dicts(tmp_path: Path) -> None:
    fabric = _fabric()
    model, optimizer = _setup(fabric)
    fabric.save(tmp_path / "c.pt", {"model": model, "optimizer": optimizer, "step": 5})
    raw = torch.load(tmp_path / "c.pt", weights_only=False)
    assert set(raw) == {"model", "optimizer", "step"}
    assert list(raw["model"]) == list(model.module.state_dict())  # no wrapper prefixes
    assert set(raw["optimizer"]) == {"state", "param_groups"}
    assert raw["step"] == 5


def test_strict_load_with_a_missing_key(tmp_path: Path) -> None:
    fabric = _fabric()
    model, _ = _setup(fabric)
    fabric.save(tmp_path / "c.pt", {"model": model})
    with pytest.raises(KeyError, match=r"the checkpoint has no entry for \['scheduler'\]"):
        fabric.load(tmp_path / "c.pt", {"model": model, "scheduler": None})


def test_non_strict_load_skips_missing_keys(tmp_path: Path) -> None:
    fabric = _fabric()
    model, _ = _setup(fabric)
    fabric.save(tmp_path / "c.pt", {"model": model, "step": 2})
    state = {"model": model, "scheduler": "untouched"}
    remainder = fabric.load(tmp_path / "c.pt", state, strict=False)
    assert state["scheduler"] == "untouched"
    assert remainder == {"step": 2}


def test_load_without_state_returns_the_whole_checkpoint(tmp_path: Path) -> None:
    fabric = _fabric()
    model, _ = _setup(fabric)
    fabric.save(tmp_path / "c.pt", {"model": model, "step": 9})
    checkpoint = fabric.load(tmp_path / "c.pt")
    assert checkpoint["step"] == 9
    assert set(checkpoint["model"]) == set(model.state_dict())


def test_load_raw_of_a_plain_state_dict(tmp_path: Path) -> None:
    source = _model()
    torch.save(source.state_dict(), tmp_path / "weights.pt")
    fabric = _fabric()
    model, _ = _setup(fabric)
    fabric.load_raw(tmp_path / "weights.pt", model)
    for key, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[key], value)


def test_load_raw_into_an_optimizer(tmp_path: Path) -> None:
    fabric = _fabric()
    _, optimizer = _setup(fabric, lr=0.1)
    state = optimizer.optimizer.state_dict()
    state["param_groups"][0]["lr"] = 0.7
    torch.save(state, tmp_path / "opt.pt")
    fabric.load_raw(tmp_path / "opt.pt", optimizer)
    assert optimizer.optimizer.param_groups[0]["lr"] == 0.7


def test_save_with_a_filter(tmp_path: Path) -> None:
    fabric = _fabric()
    model, _ = _setup(fabric)
    fabric.save(tmp_path / "c.pt", {"model": model, "step": 1}, filter={"model": lambda k, v: "weight" in k})
    raw = torch.load(tmp_path / "c.pt", weights_only=False)
    assert sorted(raw["model"]) == ["0.weight", "2.weight"]
    assert raw["step"] == 1


def test_save_with_a_filter_key_not_in_the_state(tmp_path: Path) -> None:
    fabric = _fabric()
    model, _ = _setup(fabric)
    with pytest.raises(KeyError, match=r"save\(filter=\['modle'\]\): these filter keys are not in the state"):
        fabric.save(tmp_path / "c.pt", {"model": model}, filter={"modle": lambda k, v: True})
    assert not (tmp_path / "c.pt").exists()


def test_save_with_a_filter_on_a_plain_value(tmp_path: Path) -> None:
    fabric = _fabric()
    with pytest.raises(TypeError, match=r"save\(filter=\{'step': ...\}\): state\['step'\] is not a dict"):
        fabric.save(tmp_path / "c.pt", {"step": 1}, filter={"step": lambda k, v: True})


def test_load_into_a_model_of_another_shape(tmp_path: Path) -> None:
    fabric = _fabric()
    model, _ = _setup(fabric)
    fabric.save(tmp_path / "c.pt", {"model": model})
    other = fabric.setup(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)))
    with pytest.raises(RuntimeError, match=r"the saved weights do not fit Sequential"):
        fabric.load(tmp_path / "c.pt", {"model": other})


def test_save_a_state_that_is_not_a_dict(tmp_path: Path) -> None:
    fabric = _fabric()
    model, _ = _setup(fabric)
    with pytest.raises(TypeError, match=r"save\(state=_FabricModule\): the state must be a dict"):
        fabric.save(tmp_path / "c.pt", model)  # type: ignore[arg-type]
    assert not (tmp_path / "c.pt").exists()


def test_load_a_missing_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no checkpoint exists at this path"):
        _fabric().load(tmp_path / "missing.pt")


def test_optimizer_wrapper_sees_the_loaded_learning_rate(tmp_path: Path) -> None:
    fabric = _fabric()
    _, optimizer = _setup(fabric, lr=1.0)
    fabric.save(tmp_path / "c.pt", {"optimizer": optimizer})
    optimizer.param_groups[0]["lr"] = 0.3
    fabric.load(tmp_path / "c.pt", {"optimizer": optimizer})
    assert optimizer.param_groups[0]["lr"] == optimizer.optimizer.param_groups[0]["lr"] == 1.0


# -- seeding --------------------------------------------------------------------------------------------------
def test_seed_everything_returns_the_seed_and_reproduces_draws() -> None:
    assert Fabric.seed_everything(42) == 42
    first = (random.random(), torch.rand(3))
    assert _fabric().seed_everything(42, verbose=False) == 42
    second = (random.random(), torch.rand(3))
    assert first[0] == second[0]
    assert torch.equal(first[1], second[1])

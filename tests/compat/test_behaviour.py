"""Behaviour that Lightning Fabric code relies on: wrapper device/dtype, hook calls, deprecated aliases."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from fabric import Fabric


def _fabric(**kwargs: Any) -> Fabric:
    return Fabric(accelerator="cpu", devices=1, **kwargs)


# -- 1. .device and .dtype on the wrapped module -------------------------------------------------------------


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("32-true", torch.float32), ("bf16-true", torch.bfloat16), ("16-true", torch.float16),
     ("64-true", torch.float64), ("bf16-mixed", torch.float32)],
)  # fmt: skip
def test_wrapped_module_reports_device_and_the_dtype_of_its_converted_weights(precision: str, dtype: Any) -> None:
    model = _fabric(precision=precision).setup(nn.Linear(2, 2))
    assert model.device == torch.device("cpu")
    assert model.dtype == dtype == model.weight.dtype


def test_wrapped_module_dtype_and_device_follow_to_and_the_cast_methods() -> None:
    model = _fabric().setup(nn.Sequential(nn.Linear(2, 2)))
    model.to(torch.float64)
    assert (model.dtype, model.module[0].weight.dtype) == (torch.float64, torch.float64)
    model.half()
    assert model.dtype == torch.float16
    model.bfloat16()
    assert model.dtype == torch.bfloat16
    model.to("cpu", dtype=torch.float32)
    assert (model.device, model.dtype) == (torch.device("cpu"), torch.float32)
    model.cpu()
    assert model.device == torch.device("cpu")


def test_wrapped_module_dtype_cannot_be_assigned() -> None:
    model = _fabric().setup(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match=r"module.dtype = torch.float16: the dtype cannot be assigned.*module.to"):
        model.dtype = torch.float16


def test_module_set_up_without_moving_reports_where_its_weights_are() -> None:
    fabric = _fabric()
    model = fabric.setup_module(nn.Linear(2, 2).to(torch.float64), move_to_device=False)
    assert (model.device, model.dtype) == (torch.device("cpu"), torch.float64)


# -- 2. fabric.call passes each callback only the keyword arguments it accepts ------------------------------------


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []


class _OnlyResults(_Recorder):
    def on_epoch_end(self, results: Any) -> None:
        self.calls.append(("results", (), {"results": results}))


class _TakesAll(_Recorder):
    def on_epoch_end(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("all", args, kwargs))


class _KeywordOnly(_Recorder):
    def on_epoch_end(self, *, epoch: int) -> None:
        self.calls.append(("epoch", (), {"epoch": epoch}))


class _NoArguments(_Recorder):
    def on_epoch_end(self) -> None:
        self.calls.append(("none", (), {}))


def test_call_filters_keyword_arguments_per_callback_signature() -> None:
    callbacks = [_OnlyResults(), _TakesAll(), _KeywordOnly(), _NoArguments()]
    fabric = _fabric(callbacks=callbacks)
    fabric.call("on_epoch_end", results={"loss": 1.0}, epoch=3)
    assert callbacks[0].calls == [("results", (), {"results": {"loss": 1.0}})]
    assert callbacks[1].calls == [("all", (), {"results": {"loss": 1.0}, "epoch": 3})]
    assert callbacks[2].calls == [("epoch", (), {"epoch": 3})]
    assert callbacks[3].calls == [("none", (), {})]


def test_call_passes_positional_arguments_and_skips_callbacks_without_the_hook() -> None:
    recorder = _TakesAll()
    fabric = _fabric(callbacks=[recorder, object()])
    fabric.call("on_epoch_end", 1, 2, flag=True)
    fabric.call("on_something_else", 5)
    assert recorder.calls == [("all", (1, 2), {"flag": True})]


def test_call_warns_about_a_hook_attribute_that_is_not_callable() -> None:
    class NotCallable:
        on_epoch_end = 5

    fabric = _fabric(callbacks=[NotCallable()])
    with pytest.warns(UserWarning, match=r"NotCallable.on_epoch_end is not callable \(int\), so it was skipped"):
        fabric.call("on_epoch_end")


# -- 3. the hooks Fabric fires itself ---------------------------------------------------------------------------


class _Hooks:
    def __init__(self) -> None:
        self.after_setup: list[dict[str, Any]] = []
        self.after_step: list[dict[str, Any]] = []

    def on_after_setup(self, fabric: Fabric, module: nn.Module) -> None:
        self.after_setup.append({"fabric": fabric, "module": module})

    def on_after_optimizer_step(self, strategy: Any, optimizer: Any) -> None:
        self.after_step.append({"strategy": strategy, "optimizer": optimizer})


def test_setup_fires_on_after_setup_with_the_fabric_and_the_wrapped_module() -> None:
    hooks = _Hooks()
    fabric = _fabric(callbacks=hooks)
    model = fabric.setup(nn.Linear(2, 2))
    module = nn.Linear(2, 2)
    model2, _ = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    assert [(c["fabric"], c["module"]) for c in hooks.after_setup] == [(fabric, model), (fabric, model2)]


def test_setup_module_does_not_fire_on_after_setup_as_in_lightning() -> None:
    hooks = _Hooks()
    _fabric(callbacks=hooks).setup_module(nn.Linear(2, 2))
    assert hooks.after_setup == []


def test_optimizer_step_fires_on_after_optimizer_step_with_strategy_and_optimizer() -> None:
    hooks = _Hooks()
    fabric = _fabric(callbacks=[hooks])
    raw = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    model = fabric.setup_module(nn.Linear(2, 2))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    optimizer.step()
    assert len(hooks.after_step) == 2
    assert hooks.after_step[0]["strategy"] is fabric.strategy
    assert hooks.after_step[0]["optimizer"] is optimizer.optimizer
    assert raw is not optimizer.optimizer


def test_on_after_optimizer_step_gets_only_the_arguments_it_names() -> None:
    class OnlyStrategy:
        seen: list[Any] = []

        def on_after_optimizer_step(self, strategy: Any) -> None:
            self.seen.append(strategy)

    fabric = _fabric(callbacks=OnlyStrategy())
    module = nn.Linear(2, 2)
    _model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    optimizer.step()
    assert OnlyStrategy.seen == [fabric.strategy]


# -- scheduler= in setup, as Lightning Fabric accepts it --------------------------------------------------------


def test_setup_returns_the_scheduler_last() -> None:
    module = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    _model, opt, sched = _fabric().setup(module, optimizer, scheduler=scheduler)
    assert sched is scheduler
    assert opt.param_groups is optimizer.param_groups


def test_setup_scheduler_without_optimizer_is_an_error() -> None:
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    with pytest.raises(ValueError, match=r"scheduler=StepLR\): a scheduler needs its optimizer"):
        _fabric().setup(nn.Linear(2, 2), scheduler=scheduler)


# -- 5. sharded_model, the deprecated alias of init_module ------------------------------------------------------


def test_sharded_model_warns_and_acts_as_init_module() -> None:
    fabric = _fabric(precision="bf16-true")
    with pytest.warns(DeprecationWarning, match=r"fabric.sharded_model\(\) is deprecated.*fabric.init_module\(\)"):
        context = fabric.sharded_model()
    with context:
        model = nn.Linear(2, 2)
    assert model.weight.dtype == torch.bfloat16  # what init_module does for bf16-true


def test_sharded_model_warning_points_at_the_callers_line() -> None:
    fabric = _fabric()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.sharded_model()
    assert [w.filename for w in caught] == [__file__]


# -- 4. names are case-insensitive ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "strategy", "precision"),
    [({"strategy": "DDP", "devices": 2}, "DDPStrategy", "Precision"),
     ({"strategy": "Single_Device"}, "SingleDeviceStrategy", "Precision"),
     ({"strategy": "AUTO", "precision": "BF16-Mixed"}, "SingleDeviceStrategy", "MixedPrecision"),
     ({"precision": "BF16-TRUE"}, "SingleDeviceStrategy", "HalfPrecision")],
)  # fmt: skip
def test_strategy_accelerator_and_precision_names_are_case_insensitive(
    flags: dict[str, Any], strategy: str, precision: str
) -> None:
    fabric = Fabric(accelerator="CPU", **flags)
    assert type(fabric.accelerator).__name__ == "CPUAccelerator"
    assert type(fabric.strategy).__name__ == strategy
    assert type(fabric.strategy.precision).__name__ == precision


def test_registry_lookups_ignore_case_and_names_are_listed_in_lower_case() -> None:
    from fabric import STRATEGY_REGISTRY, SingleDeviceStrategy

    STRATEGY_REGISTRY.register("My_Strategy", SingleDeviceStrategy, "test")
    try:
        assert "my_strategy" in STRATEGY_REGISTRY.names()
        assert "MY_STRATEGY" in STRATEGY_REGISTRY
        assert STRATEGY_REGISTRY.get("my_STRATEGY")[0] is SingleDeviceStrategy
        assert type(Fabric(accelerator="cpu", strategy="MY_strategy").strategy) is SingleDeviceStrategy
        with pytest.raises(ValueError, match=r"register\('my_strategy'\): this strategy name is already registered"):
            STRATEGY_REGISTRY.register("my_strategy", SingleDeviceStrategy)
    finally:
        STRATEGY_REGISTRY.remove("MY_STRATEGY")
    assert "my_strategy" not in STRATEGY_REGISTRY


def test_an_unknown_name_in_any_case_is_still_an_error() -> None:
    with pytest.raises(ValueError, match=r"unknown strategy 'ddp_spwan'"):
        Fabric(accelerator="cpu", strategy="DDP_SPWAN")


# -- 7. a single-process Fabric inside a process group that is already running ----------------------------------


def _fake_group(monkeypatch: pytest.MonkeyPatch, world_size: int, rank: int) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world_size)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)


@pytest.mark.usefixtures("no_cluster_env")
@pytest.mark.parametrize("flags", [{"devices": 1}, {"devices": "1"}, {"devices": 1, "strategy": "single_device"}])
def test_explicit_single_device_inside_a_running_group_is_standalone(
    monkeypatch: pytest.MonkeyPatch, flags: dict[str, Any]
) -> None:
    _fake_group(monkeypatch, 2, 1)
    fabric = Fabric(accelerator="cpu", **flags)
    assert type(fabric.strategy).__name__ == "SingleDeviceStrategy"
    assert (fabric.world_size, fabric.global_rank, fabric.is_global_zero) == (1, 0, True)
    assert fabric.strategy.launcher is None


@pytest.mark.usefixtures("no_cluster_env")
def test_ddp_on_one_device_inside_a_larger_group_is_still_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_group(monkeypatch, 2, 0)
    with pytest.raises(ValueError, match=r"not 1 x 1\..*pass devices=1 with strategy 'auto' or 'single_device'"):
        Fabric(accelerator="cpu", strategy="ddp", devices=1)


# -- Lightning's subclass style: override Fabric.run ------------------------------------------------------------


class _RunFabric(Fabric):
    def run(self, scale: float, offset: float = 0.0) -> tuple[int, float, bool]:
        model = self.setup(nn.Linear(1, 1, bias=False))
        total = self.all_reduce(torch.tensor(float(self.global_rank + 1)) * scale, reduce_op="sum")
        return self.global_rank, total.item() + offset, self._launched and model.device == self.device


def test_overridden_run_launches_and_returns_its_result() -> None:
    assert _RunFabric(accelerator="cpu", devices=1).run(3.0, offset=1.0) == (0, 4.0, True)


def test_overridden_run_can_be_called_only_once_like_launch() -> None:
    fabric = _RunFabric(accelerator="cpu", devices=1)
    fabric.run(1.0)
    with pytest.raises(RuntimeError, match=r"launch was already called for this Fabric object"):
        fabric.run(1.0)


def test_base_run_does_nothing_and_does_not_launch() -> None:
    fabric = _fabric()
    assert fabric.run() is None
    assert not fabric._launch_called


# -- a torch.compile'd model ----------------------------------------------------------------------------------


def test_compiled_model_keeps_running_compiled_but_exposes_the_inner_module() -> None:
    inner = nn.Linear(2, 2)
    compiled = torch.compile(inner, backend="eager")
    model = _fabric().setup(compiled)
    assert sorted(model.state_dict()) == ["bias", "weight"], "no '_orig_mod.' prefix, as in Lightning Fabric"
    assert model.module is inner
    assert model._forward_module is compiled
    torch.testing.assert_close(model(torch.ones(1, 2)), inner(torch.ones(1, 2)))


def test_call_filters_the_same_way_for_static_class_and_bound_methods_and_plain_functions() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    class Hooks:
        @staticmethod
        def static_hook(epoch: int) -> None:
            seen.append(("static", {"epoch": epoch}))

        @classmethod
        def class_hook(cls, epoch: int) -> None:
            seen.append(("class", {"epoch": epoch}))

        def bound_hook(self, epoch: int) -> None:
            seen.append(("bound", {"epoch": epoch}))

    holder = Hooks()
    holder.function_hook = lambda epoch: seen.append(("function", {"epoch": epoch}))  # type: ignore[attr-defined]
    fabric = _fabric(callbacks=holder)
    for hook in ("static_hook", "class_hook", "bound_hook", "function_hook"):
        fabric.call(hook, epoch=1, cls="not passed", extra=2)
    assert [name for name, _ in seen] == ["static", "class", "bound", "function"]
    assert all(kwargs == {"epoch": 1} for _, kwargs in seen)


def test_reapply_compile_false_keeps_the_compile_wrapper_as_the_module() -> None:
    compiled = torch.compile(nn.Linear(2, 2), backend="eager")
    model = _fabric().setup_module(compiled, _reapply_compile=False)
    assert model.module is compiled
    assert sorted(model.state_dict()) == ["_orig_mod.bias", "_orig_mod.weight"]

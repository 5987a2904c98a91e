"""Tests for what fabric.setup returns: the module and optimizer wrappers and the loss.backward() guard."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch import nn

from fabric import MixedPrecision, Precision, SingleDeviceStrategy
from fabric.wrappers import _BackwardState, _FabricModule, _FabricOptimizer, is_wrapped, unwrap_objects


class _UserModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)
        self.register_buffer("running", torch.zeros(2))
        self.custom_flag = "mine"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def double_it(self, value: int) -> int:
        return 2 * value


class _SpyStrategy(SingleDeviceStrategy):
    """Records what the optimizer wrapper asks of the strategy."""

    def __init__(self) -> None:
        super().__init__(device="cpu")
        self.steps: list[tuple[torch.optim.Optimizer, dict[str, Any]]] = []
        self.state_requests = 0

    def optimizer_step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        self.steps.append((optimizer, kwargs))
        return super().optimizer_step(optimizer, **kwargs)

    def get_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        self.state_requests += 1
        return super().get_optimizer_state(optimizer)


class _MustUseFabricBackward(Precision):
    """A precision for which a plain loss.backward() would be wrong, like float16 with a loss scaler."""

    @property
    def requires_fabric_backward(self) -> bool:
        return True


def _wrap(model: nn.Module, precision: Precision | None = None) -> _FabricModule:
    return _FabricModule(model, model, precision or Precision())


# -- module --------------------------------------------------------------------------------------------
def test_forward_under_bf16_mixed_returns_float32() -> None:
    model = _UserModel()
    seen: list[torch.dtype] = []
    model.layer.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    wrapped = _wrap(model, MixedPrecision("bf16-mixed", device="cpu"))
    out = wrapped(torch.randn(3, 4))
    assert seen == [torch.bfloat16]  # the linear layer ran under autocast
    assert out.dtype == torch.float32  # and the user gets the default dtype back
    assert out.shape == (3, 2)


def test_forward_in_full_precision_equals_the_module() -> None:
    model = _UserModel()
    x = torch.randn(3, 4)
    assert torch.equal(_wrap(model)(x), model(x))


def test_a_plain_call_skips_torchs_module_call_and_hooks_still_run(monkeypatch: pytest.MonkeyPatch) -> None:
    wrapped = _wrap(_UserModel())
    x = torch.ones(3, 4)

    def torch_call(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torch's Module.__call__ ran")

    monkeypatch.setattr(_FabricModule, "_call_impl", torch_call)
    assert torch.equal(wrapped(x), wrapped.module(x)), "no hook anywhere: the module is called at once"
    monkeypatch.undo()
    mixed = _wrap(_UserModel(), MixedPrecision("bf16-mixed", device="cpu"))
    assert mixed(x).dtype == torch.float32, "a forward with work of its own goes through torch's call"
    seen: list[str] = []
    wrapped(x)  # called before any hook: what a call runs is decided again when a hook comes
    handle = wrapped.register_forward_hook(lambda module, args, output: seen.append("wrapper hook"))
    wrapped(x)
    handle.remove()
    with torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: seen.append("global")):
        wrapped(x)
    assert seen[0] == "wrapper hook" and "global" in seen, "hooks on the wrapper and global hooks still run"
    calls: list[str] = []
    wrapped._compiled_call_impl = lambda *args, **kwargs: calls.append("compiled")  # what Module.compile() sets
    wrapped(x)
    assert calls == ["compiled"]


@pytest.mark.parametrize(
    "register",
    [
        lambda m, seen: m.register_forward_pre_hook(lambda *a: seen.append("forward pre")),
        lambda m, seen: m.register_forward_pre_hook(lambda *a, **k: seen.append("forward pre"), with_kwargs=True),
        lambda m, seen: m.register_forward_hook(lambda *a: seen.append("forward")),
        lambda m, seen: m.register_full_backward_pre_hook(lambda *a: seen.append("backward pre")),
        lambda m, seen: m.register_full_backward_hook(lambda *a: seen.append("backward")),
    ],
    ids=["forward pre", "forward pre with kwargs", "forward", "full backward pre", "full backward"],
)
def test_a_hook_registered_on_the_wrapper_after_calls_runs(register: Any) -> None:
    wrapped = _wrap(_UserModel())
    x = torch.ones(3, 4, requires_grad=True)
    wrapped(x).sum().backward()
    seen: list[str] = []
    register(wrapped, seen)
    wrapped(x).sum().backward()
    assert len(seen) == 1, f"the hook ran {len(seen)} times in one forward and backward: {seen}"


def test_module_compile_of_the_wrapper_runs_compiled() -> None:
    wrapped = _wrap(_UserModel())
    x = torch.randn(3, 4)
    wrapped.compile(backend="eager")
    assert wrapped._compiled_call_impl is not None and wrapped._fabric_call is None
    assert torch.equal(wrapped(x), wrapped.module(x))


def test_the_wrapper_compiles_traces_copies_and_saves_with_its_own_module(tmp_path: Any) -> None:
    import copy

    wrapped = _wrap(_UserModel())
    x = torch.randn(3, 4)
    expected = wrapped.module(x)
    assert torch.equal(torch.compile(wrapped, backend="eager", fullgraph=True)(x), expected)
    assert torch.equal(torch.compile(lambda t: wrapped(t) * 2, backend="eager", fullgraph=True)(x), expected * 2)
    assert torch.equal(torch.jit.trace(wrapped, x)(x), expected)
    copied = copy.deepcopy(wrapped)
    torch.save(wrapped, tmp_path / "wrapped.pt")
    loaded = torch.load(tmp_path / "wrapped.pt", weights_only=False)
    for other in (copied, loaded):
        with torch.no_grad():
            other.module.layer.weight.add_(1.0)
        assert torch.equal(other(x), other.module(x)), "a copy calls its own module"
        assert not torch.equal(other(x), expected)
    assert torch.equal(wrapped(x), expected), "the original is untouched"


def test_a_guarded_call_lifts_the_guard_only_while_it_runs() -> None:
    from fabric._forward_methods import _ForwardGuard

    class _Failing(_UserModel):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[-1] != 4:
                raise ValueError(f"expected 4 features, got {x.shape[-1]}")
            return super().forward(x)

    model = _Failing()
    guard = _ForwardGuard()
    depths: list[int] = []
    model.register_forward_pre_hook(lambda *a: depths.append(guard.depth))
    wrapped = _FabricModule(model, model, Precision(), forward_guard=guard)
    assert wrapped._fabric_guard is guard, "a guarded forward skips torch's call on the wrapper"
    x = torch.ones(3, 4)
    assert torch.equal(wrapped(x), model(x)) and depths == [1, 0], "lifted in the wrapper's call, not after"
    with pytest.raises(ValueError, match="expected 4 features"):
        wrapped(torch.ones(3, 5))
    assert guard.depth == 0, "a failing forward drops the guard again"
    wrapped.register_forward_hook(lambda *a: None)  # now torch's call runs, which lifts the guard in forward()
    assert wrapped._fabric_guard is None and wrapped._fabric_call is None
    depths.clear()
    assert torch.equal(wrapped(x), model(x)) and depths == [1, 0] and guard.depth == 0


def test_attributes_and_methods_of_the_user_module_pass_through() -> None:
    model = _UserModel()
    wrapped = _wrap(model)
    assert wrapped.custom_flag == "mine"
    assert wrapped.double_it(21) == 42
    assert wrapped.layer is model.layer
    assert wrapped.running is model.running
    assert wrapped.module is model
    with pytest.raises(AttributeError, match="no_such_thing"):
        _ = wrapped.no_such_thing


def test_setattr_reaches_the_user_module() -> None:
    model = _UserModel()
    wrapped = _wrap(model)
    wrapped.custom_flag = "changed"
    wrapped.new_attribute = 3
    assert model.custom_flag == "changed"
    assert model.new_attribute == 3
    head = nn.Linear(2, 1)
    wrapped.head = head
    assert model.head is head
    assert "head.weight" in model.state_dict()


def test_state_dict_has_the_user_module_keys() -> None:
    model = _UserModel()
    wrapped = _wrap(model)
    assert list(wrapped.state_dict()) == list(model.state_dict())
    assert sorted(wrapped.state_dict()) == ["layer.bias", "layer.weight", "running"]


def test_load_state_dict_loads_into_the_user_module() -> None:
    model = _UserModel()
    source = _UserModel()
    source.running.fill_(3.0)
    wrapped = _wrap(model)
    result = wrapped.load_state_dict(source.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(model.layer.weight, source.layer.weight)
    assert torch.equal(model.running, torch.full((2,), 3.0))


def test_parameters_are_listed_once() -> None:
    model = _UserModel()
    assert len(list(_wrap(model).parameters())) == len(list(model.parameters())) == 2


# -- optimizer -------------------------------------------------------------------------------------------
def _optimizer(lr: float = 1.0) -> tuple[_UserModel, torch.optim.SGD]:
    model = _UserModel()
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def test_optimizer_wrapper_is_an_instance_of_the_original_class() -> None:
    _, optimizer = _optimizer()
    wrapped = _FabricOptimizer(optimizer, _SpyStrategy())
    assert isinstance(wrapped, torch.optim.SGD)
    assert isinstance(wrapped, torch.optim.Optimizer)
    assert wrapped.optimizer is optimizer
    assert wrapped.defaults == optimizer.defaults


def test_optimizer_wrapper_shares_param_groups() -> None:
    _, optimizer = _optimizer()
    wrapped = _FabricOptimizer(optimizer, _SpyStrategy())
    wrapped.param_groups[0]["lr"] = 0.25
    assert optimizer.param_groups[0]["lr"] == 0.25
    optimizer.param_groups[0]["lr"] = 0.5
    assert wrapped.param_groups[0]["lr"] == 0.5
    assert wrapped.state is optimizer.state


def test_step_goes_through_the_strategy() -> None:
    model, optimizer = _optimizer()
    strategy = _SpyStrategy()
    wrapped = _FabricOptimizer(optimizer, strategy)
    model(torch.ones(1, 4)).sum().backward()
    before = model.layer.bias.detach().clone()
    wrapped.step()
    assert strategy.steps == [(optimizer, {})]
    assert torch.equal(model.layer.bias, before - 1.0)  # d(sum)/d(bias) = 1, lr = 1
    wrapped.zero_grad()
    assert model.layer.bias.grad is None


def test_step_passes_the_closure_to_the_strategy() -> None:
    model, optimizer = _optimizer()
    strategy = _SpyStrategy()
    calls: list[int] = []

    def closure() -> torch.Tensor:
        calls.append(1)
        optimizer.zero_grad()
        loss = model(torch.ones(1, 4)).sum()
        loss.backward()
        return loss

    loss = _FabricOptimizer(optimizer, strategy).step(closure)
    assert calls == [1]
    assert strategy.steps[0][1]["closure"] is closure
    assert isinstance(loss, torch.Tensor)


def test_lr_scheduler_on_the_wrapper_changes_the_real_lr() -> None:
    model, optimizer = _optimizer(lr=1.0)
    strategy = _SpyStrategy()
    wrapped = _FabricOptimizer(optimizer, strategy)
    scheduler = torch.optim.lr_scheduler.StepLR(wrapped, step_size=1, gamma=0.5)
    for _ in range(3):
        model(torch.ones(1, 4)).sum().backward()
        wrapped.step()  # no recursion through the scheduler's patched step
        scheduler.step()
    assert len(strategy.steps) == 3
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.125)
    assert scheduler.get_last_lr() == [pytest.approx(0.125)]


def test_optimizer_state_dict_comes_from_the_strategy_and_equals_the_original() -> None:
    model, optimizer = _optimizer()
    strategy = _SpyStrategy()
    wrapped = _FabricOptimizer(optimizer, strategy)
    model(torch.ones(1, 4)).sum().backward()
    wrapped.step()
    state = wrapped.state_dict()
    assert strategy.state_requests == 1
    expected = optimizer.state_dict()
    assert state["param_groups"] == expected["param_groups"]
    assert state["state"].keys() == expected["state"].keys()
    for key in expected["state"]:
        assert torch.equal(state["state"][key]["momentum_buffer"], expected["state"][key]["momentum_buffer"])


def test_optimizer_load_state_dict_reaches_the_original() -> None:
    _, optimizer = _optimizer()
    wrapped = _FabricOptimizer(optimizer, _SpyStrategy())
    state = optimizer.state_dict()
    state["param_groups"][0]["lr"] = 0.01
    wrapped.load_state_dict(state)
    assert optimizer.param_groups[0]["lr"] == 0.01


def test_wrapper_sees_param_groups_after_load_state_dict() -> None:
    _, optimizer = _optimizer()
    wrapped = _FabricOptimizer(optimizer, _SpyStrategy())
    state = optimizer.state_dict()
    state["param_groups"][0]["lr"] = 0.01
    wrapped.load_state_dict(state)
    assert wrapped.param_groups[0]["lr"] == 0.01


# -- unwrapping --------------------------------------------------------------------------------------------
def test_unwrap_objects() -> None:
    model, optimizer = _optimizer()
    wrapped_model = _wrap(model)
    wrapped_optimizer = _FabricOptimizer(optimizer, _SpyStrategy())
    assert unwrap_objects(wrapped_model) is model
    assert unwrap_objects(wrapped_optimizer) is optimizer
    assert unwrap_objects(model) is model
    assert unwrap_objects(42) == 42
    assert is_wrapped(wrapped_model) and is_wrapped(wrapped_optimizer)
    assert not is_wrapped(model) and not is_wrapped(optimizer)


def test_unwrap_objects_sees_through_a_compiled_module() -> None:
    model = _UserModel()

    class _Compiled(nn.Module):  # what torch.compile returns keeps the module as _orig_mod
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self._orig_mod = inner

    compiled = _Compiled(model)
    assert unwrap_objects(compiled) is model
    assert unwrap_objects(_FabricModule(compiled, compiled, Precision())) is model


# -- loss.backward() guard ----------------------------------------------------------------------------------
def test_plain_backward_is_refused_when_the_precision_needs_fabric_backward() -> None:
    model = _UserModel()
    state = _BackwardState()
    wrapped = _FabricModule(model, model, _MustUseFabricBackward(), state)
    output = wrapped(torch.randn(2, 4))
    with pytest.raises(RuntimeError, match=r"loss.backward\(\):.*Call fabric.backward\(loss\) instead"):
        output.sum().backward()
    assert model.layer.weight.grad is None


def test_backward_inside_fabric_backward_is_allowed() -> None:
    model = _UserModel()
    state = _BackwardState()
    wrapped = _FabricModule(model, model, _MustUseFabricBackward(), state)
    output = wrapped(torch.randn(2, 4))
    state.active = True
    output.sum().backward()
    assert model.layer.weight.grad is not None
    assert torch.equal(model.layer.bias.grad, torch.full((2,), 2.0))


def test_outputs_in_collections_are_guarded_too() -> None:
    class _TwoOutputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> dict[str, Any]:
            y = self.layer(x)
            return {"a": y, "b": [y * 2], "n": 3}

    model = _TwoOutputs()
    wrapped = _FabricModule(model, model, _MustUseFabricBackward(), _BackwardState())
    out = wrapped(torch.ones(1, 2))
    assert out["n"] == 3
    with pytest.raises(RuntimeError, match=r"fabric.backward"):
        out["b"][0].sum().backward()


def test_without_backward_state_plain_backward_works() -> None:
    model = _UserModel()
    wrapped = _FabricModule(model, model, _MustUseFabricBackward(), None)
    wrapped(torch.randn(2, 4)).sum().backward()
    assert model.layer.weight.grad is not None


# -- cost per step ------------------------------------------------------------------------------------------------
def _python_calls(step: Any) -> int:
    """How many Python functions one call of `step` runs (C functions, such as torch's kernels, not counted).

    The fewest of three calls, with the garbage collector off: a collection during the step runs finalizers and
    weakref callbacks of objects earlier tests left behind, which are not the step's calls.
    """
    import gc

    counts = []
    for _ in range(3):
        calls = 0

        def count(frame: Any, event: str, arg: Any) -> None:
            nonlocal calls
            calls += event == "call"

        enabled = gc.isenabled()
        gc.collect()
        gc.disable()
        sys.setprofile(count)
        try:
            step()
        finally:
            sys.setprofile(None)
            if enabled:
                gc.enable()
        counts.append(calls)
    return min(counts)


def test_a_32_bit_training_step_adds_three_python_calls_at_most() -> None:
    from fabric import Fabric

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    raw_model, raw_optimizer = make()
    fabric = Fabric(accelerator="cpu", devices=1)
    model, optimizer = fabric.setup(*make())
    x = torch.ones(2, 4)

    def raw_step() -> None:
        loss = raw_model(x).sum()
        raw_optimizer.zero_grad()
        loss.backward()
        raw_optimizer.step()

    def fabric_step() -> None:
        loss = model(x).sum()
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()

    raw_step(), fabric_step()  # first steps create the optimizer state and import what they need
    # The wrapper's __call__ (not torch's Module.__call__ and forward), Fabric.backward, the wrapper's step
    # (zero_grad is the user's own, bound): no strategy or precision frame (they add nothing here), precision
    # context, conversion, guard or hook on the way.
    assert _python_calls(fabric_step) - _python_calls(raw_step) <= 3


class _CountingPrecision(Precision):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        self.calls.append("backward")
        super().backward(tensor, module, *args, **kwargs)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        self.calls.append("optimizer_step")
        return super().optimizer_step(optimizer, **kwargs)


def test_a_precision_plugin_that_overrides_backward_or_step_is_still_called_every_step() -> None:
    from fabric import Fabric

    precision = _CountingPrecision()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[precision])
    model = nn.Linear(4, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(2):
        fabric.backward(model(torch.ones(2, 4)).sum())
        optimizer.step()
        optimizer.step(lambda: None)  # with a closure too
    assert precision.calls == ["backward", "optimizer_step", "optimizer_step"] * 2

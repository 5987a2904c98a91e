"""Silent mistakes that fabric turns into clear errors or one-time warnings (single process; see also
tests/integration/test_mistakes_ddp.py for the cases only several processes expose)."""

from __future__ import annotations

import copy
import pickle
import re
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from fabric import Fabric, Precision, _mistakes
from fabric.loggers import CSVLogger
from fabric.strategies import SingleDeviceStrategy
from fabric.utilities.warnings import PossibleUserWarning
from fabric.wrappers import _FabricModule


def _fabric(**kwargs: Any) -> Fabric:
    return Fabric(accelerator="cpu", devices=1, **kwargs)


@pytest.fixture
def no_warnings() -> Iterator[None]:
    """Every warning inside the test is an error: the correct code here must warn about nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# -- an optimizer and the model it is set up with ----------------------------------------------------------------
def test_optimizer_over_another_instance_is_refused() -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "fabric.setup(Linear, ..., SGD): none of the optimizer's 2 parameters belongs to the model it was passed "
            "with, so its steps would never change that model"
        ),
    ) as error:
        _fabric().setup(model, optimizer)
    assert "torch.optim.SGD(model.parameters(), ...)" in str(error.value)
    assert "fabric.setup_module(model) and the optimizer with fabric.setup_optimizers(optimizer)" in str(error.value)


@pytest.mark.usefixtures("no_warnings")
def test_legitimate_optimizers_pass_silently() -> None:
    fabric = _fabric()
    # Over a subset of the model (a fine-tuned head).
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    fabric.setup(model, torch.optim.SGD(model[1].parameters(), lr=0.1))
    # Model parameters plus a learnable loss weight outside it: fine on one process.
    model = nn.Linear(2, 2)
    fabric.setup(model, torch.optim.SGD([*model.parameters(), nn.Parameter(torch.ones(1))], lr=0.1))
    # A frozen model with an optimizer over an input image (style transfer): nothing of the model to train.
    frozen = nn.Linear(2, 2).requires_grad_(False)
    image = torch.zeros(1, 2, requires_grad=True)
    fabric.setup(frozen, torch.optim.Adam([image], lr=0.1))
    # An optimizer alone, for a model set up before.
    model = fabric.setup_module(nn.Linear(2, 2))
    fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))


def test_partly_outside_optimizer_warns_once_per_fabric_with_several_processes() -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.ones(3))], lr=0.1)
    for _ in range(2):  # two Fabric objects: each warns once, neither silences the other
        once = _mistakes.WarnOnce()
        with pytest.warns(PossibleUserWarning) as records:
            for _ in range(2):
                _mistakes.check_optimizer_params(model, [optimizer], 2, "DDPStrategy", once)
        assert len(records) == 1
        assert str(records[0].message).startswith(
            "fabric.setup(Linear, ..., SGD): 1 of the optimizer's parameters (shapes [3]) are not in the model. "
            "DDPStrategy averages only the model's gradients across the 2 processes, so these parameters get "
            "different updates on each process and drift apart."
        )


# -- objects set up twice -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("first", ["setup", "setup_module"])
@pytest.mark.parametrize("second", ["setup", "setup_module"])
def test_original_module_set_up_again_warns_and_trains(first: str, second: str) -> None:
    # Lightning Fabric wraps the raw module again; where the strategy leaves the module as it is, so does fabric.
    fabric = _fabric()
    module = nn.Linear(2, 2)
    getattr(fabric, first)(module)
    message = (
        f"fabric.{second}(Linear): this module was already set up by this Fabric, and is now wrapped a second time, "
        "as Lightning Fabric does. Both wrappers share the weights and SingleDeviceStrategy keeps training correct"
    )
    with pytest.warns(PossibleUserWarning, match=re.escape(message)):
        again = getattr(fabric, second)(module)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(module.parameters(), lr=0.1))
    before = module.weight.detach().clone()
    fabric.backward(again(torch.ones(1, 2)).sum())
    optimizer.step()
    assert not torch.equal(module.weight, before), "the second wrapper trains the same weights"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        getattr(fabric, second)(nn.Linear(2, 2))  # a new module: no warning
        fabric.setup(module)  # the same module a third time: warned once per Fabric


class _ShardingStrategy(SingleDeviceStrategy):
    """Stands in for a strategy that changes the module when it sets it up (FSDP, DeepSpeed)."""

    repeatable_module_setup = False


@pytest.mark.parametrize("second", ["setup", "setup_module"])
def test_original_module_set_up_again_is_refused_where_the_strategy_changed_it(second: str) -> None:
    fabric = Fabric(accelerator="cpu", strategy=_ShardingStrategy())
    module = nn.Linear(2, 2)
    fabric.setup(module)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"fabric.{second}(Linear): this module was already set up by this Fabric, which returned a wrapper for "
            "it. _ShardingStrategy changes the module itself when it sets it up (it shards it, or hands it to its "
            "engine), so setting it up again would prepare it twice and train wrongly without an error."
        ),
    ):
        getattr(fabric, second)(module)


def test_a_second_fabric_may_set_up_the_same_module() -> None:
    module = nn.Linear(2, 2)
    _fabric().setup(module)
    _fabric().setup(module)  # the record is per Fabric object, as everything else is


def test_the_same_optimizer_twice_in_one_call_is_refused() -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=re.escape("fabric.setup(..., SGD, SGD): the same optimizer was passed twice")):
        _fabric().setup(model, optimizer, optimizer)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=re.escape("fabric.setup_optimizers(..., SGD, SGD): the same optimizer")):
        _fabric().setup_optimizers(other, other)


@pytest.mark.parametrize("again", ["setup", "setup_optimizers"])
def test_the_same_optimizer_across_calls_is_refused(again: str) -> None:
    fabric = _fabric()
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fabric.setup(model, optimizer)
    message = f"fabric.{again}(..., SGD): this optimizer was already set up by this Fabric."
    with pytest.raises(ValueError, match=re.escape(message)):
        if again == "setup":
            fabric.setup(nn.Linear(2, 2), optimizer)
        else:
            fabric.setup_optimizers(optimizer)


def test_a_failed_setup_records_nothing() -> None:
    fabric = _fabric()
    module = nn.Linear(2, 2)
    with pytest.raises(TypeError):
        fabric.setup(module, "adam")  # type: ignore[arg-type]
    fabric.setup(module)  # the refused call did not set the module up


# -- wrong argument types -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "shown"), [("model", "'model'"), (None, "None")])
@pytest.mark.parametrize("method", ["setup", "setup_module"])
def test_a_string_or_none_instead_of_the_model(method: str, value: Any, shown: str) -> None:
    message = f"fabric.{method}({shown}): expected your model, a torch.nn.Module, as the first argument, but got"
    with pytest.raises(TypeError, match=re.escape(message)):
        getattr(_fabric(), method)(value)


@pytest.mark.parametrize(("value", "shown"), [("adam", "'adam'"), (None, "None")])
@pytest.mark.parametrize("method", ["setup", "setup_optimizers"])
def test_a_string_or_none_instead_of_an_optimizer(method: str, value: Any, shown: str) -> None:
    fabric = _fabric()
    message = f"fabric.{method}(..., {shown}): expected a torch.optim.Optimizer, but got {type(value).__name__}."
    with pytest.raises(TypeError, match=re.escape(message)):
        if method == "setup":
            fabric.setup(nn.Linear(2, 2), value)
        else:
            fabric.setup_optimizers(value)


def test_a_scheduler_passed_as_an_optimizer() -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    message = "fabric.setup(..., StepLR): this looks like an LR scheduler, passed where an optimizer goes. Pass it "
    with pytest.raises(TypeError, match=re.escape(message + "by keyword: fabric.setup(model, optimizer, scheduler=")):
        _fabric().setup(model, optimizer, scheduler)


@pytest.mark.parametrize(("value", "shown"), [("loss", "'loss'"), (None, "None"), (1.5, "1.5")])
def test_backward_of_something_not_a_tensor(value: Any, shown: str) -> None:
    message = f"fabric.backward({shown}): expected the loss, a torch.Tensor, but got {type(value).__name__}."
    with pytest.raises(TypeError, match=re.escape(message)):
        _fabric().backward(value)


@pytest.mark.parametrize(
    ("loggers", "shown"), [(["csv"], "'csv'"), ([CSVLogger], "the class CSVLogger"), (object(), "object")]
)
def test_loggers_that_are_not_loggers(loggers: Any, shown: str) -> None:
    message = f"Fabric(loggers=[{shown}]): not a logger instance; fabric calls log_metrics() on each logger."
    with pytest.raises(TypeError, match=re.escape(message)):
        _fabric(loggers=loggers)


def test_any_object_with_log_metrics_is_a_logger() -> None:
    class Recorder:  # e.g. a Lightning logger, which fabric's Logger base does not know
        def __init__(self) -> None:
            self.seen: list[Any] = []

        def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
            self.seen.append((metrics, step))

    recorder = Recorder()
    _fabric(loggers=recorder).log("loss", 1.0, step=3)
    assert recorder.seen == [({"loss": 1.0}, 3)]


# -- clip_gradients limits ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "effect"),
    [
        ({"max_norm": 0}, "zero every gradient (flip it, if < 0)"),
        ({"max_norm": -1.0}, "zero every gradient (flip it, if < 0)"),
        ({"max_norm": float("nan")}, "zero every gradient (flip it, if < 0)"),
        ({"clip_val": 0.0}, "set every gradient to 0.0"),
        ({"clip_val": -1}, "set every gradient to -1"),
    ],
)
def test_clip_gradients_with_a_limit_that_is_not_positive(kwargs: dict[str, float], effect: str) -> None:
    fabric = _fabric()
    model, optimizer = _set_up(fabric)
    ((name, value),) = kwargs.items()
    message = f"fabric.clip_gradients({name}={value}): the limit must be a positive number; this one would {effect}"
    with pytest.raises(ValueError, match=re.escape(message)):
        fabric.clip_gradients(model, optimizer, **kwargs)


def test_clip_gradients_with_an_infinite_norm_only_measures() -> None:
    fabric = _fabric()
    model, optimizer = _set_up(fabric)
    before = [p.grad.clone() for p in model.parameters()]
    norm = fabric.clip_gradients(model, optimizer, max_norm=float("inf"))
    assert norm is not None and torch.allclose(norm, torch.cat([g.reshape(-1) for g in before]).norm())
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before, strict=True))


def _set_up(fabric: Fabric) -> tuple[Any, Any]:
    module = nn.Linear(2, 2)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    fabric.backward(model(torch.ones(1, 2)).sum())
    return model, optimizer


# -- unknown names: the closest is suggested ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flag", "value", "closest"),
    [
        ("strategy", "dpp", "ddp"),
        ("strategy", "DDP_SPWAN", "ddp_spawn"),
        ("accelerator", "cpus", "cpu"),
        ("accelerator", "gpus", "gpu"),
        ("precision", "bf16-mix", "bf16-mixed"),
    ],
)
def test_an_unknown_name_gets_the_closest_suggested(flag: str, value: str, closest: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"unknown {flag} {value.lower()!r}")) as error:
        Fabric(**{flag: value})
    assert str(error.value).endswith(f". Did you mean {closest!r}?")


def test_a_name_close_to_nothing_gets_no_suggestion() -> None:
    with pytest.raises(ValueError, match="unknown strategy 'zzzzzz'") as error:
        Fabric(strategy="zzzzzz")
    assert "Did you mean" not in str(error.value)


# -- more CPU processes than cores ----------------------------------------------------------------------------------
@pytest.mark.usefixtures("no_cluster_env")
def test_more_cpu_processes_than_cores_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    with pytest.warns(PossibleUserWarning) as records:
        Fabric(accelerator="cpu", devices=3)
    assert [str(r.message) for r in records] == [
        "Fabric(accelerator='cpu', devices=3): 3 processes on this machine, but only 2 CPU core(s) are available to "
        "this process (os.sched_getaffinity), so the processes compete for cores and the run is slower than with "
        "fewer processes. Use devices=2 or fewer."
    ]


@pytest.mark.usefixtures("no_cluster_env", "no_warnings")
def test_as_many_cpu_processes_as_cores_is_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    Fabric(accelerator="cpu", devices=2)
    monkeypatch.setenv("LOCAL_RANK", "1")  # a process the launcher started: local rank 0 warns for the run
    Fabric(accelerator="cpu", devices=3)


# -- forward of the original module ---------------------------------------------------------------------------------
def test_the_forward_guard_warns_once_and_only_with_gradients() -> None:
    module = nn.Linear(2, 2)
    once = _mistakes.WarnOnce()
    guard = _mistakes.guard_forward(module, "DDPStrategy", 2, once)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        with torch.no_grad():
            module(torch.ones(1, 2))  # inference: silent
        guard.depth += 1
        module(torch.ones(1, 2))  # called by the wrapper: silent
        guard.depth -= 1
        module(torch.ones(1, 2))
        module(torch.ones(1, 2))
    assert [str(r.message).split(" That call")[0] for r in records] == [
        "Linear.forward() was called on the module you passed to fabric.setup(), not on the model fabric.setup() "
        "returned, while gradients are enabled."
    ]


class _HookProbe(nn.Linear):
    """Records how many forward pre-hooks it had at each forward: none means torch's fast path called it."""

    def __init__(self) -> None:
        super().__init__(2, 2)
        self.hooks_seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.hooks_seen.append(len(self._forward_pre_hooks))
        return super().forward(x)


def _guarded_wrapper(module: nn.Module) -> tuple[_FabricModule, Any]:
    """A wrapper as a 2-process setup builds it; the Sequential stands in for DDP, which calls the module inside."""
    guard = _mistakes.guard_forward(module, "DDPStrategy", 2, _mistakes.WarnOnce())
    return _FabricModule(nn.Sequential(module), module, Precision(), None, guard), guard


def test_a_wrapped_forward_calls_the_guarded_module_without_its_hook() -> None:
    module = _HookProbe()
    model, _ = _guarded_wrapper(module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.ones(1, 2)).sum().backward()
        model(torch.ones(1, 2))
    # No hook while the wrapper ran (torch's hook-free fast path, as in raw DDP); watched again afterwards.
    assert module.hooks_seen == [0, 0]
    assert len(module._forward_pre_hooks) == 1
    with pytest.warns(PossibleUserWarning, match="was called on the module you passed to fabric.setup"):
        module(torch.ones(1, 2))
    assert module.hooks_seen[-1] == 1


def test_the_guard_hook_comes_back_after_a_failed_or_nested_forward_and_stays_removed_if_the_user_removed_it() -> None:
    module = _HookProbe()
    model, guard = _guarded_wrapper(module)
    with pytest.raises(RuntimeError):
        model(torch.ones(1, 3))  # a shape error inside the forward
    assert len(module._forward_pre_hooks) == 1 and guard.depth == 0
    guard.lift()  # an outer wrapper of the same module (a second Fabric's) is running
    model(torch.ones(1, 2))
    assert len(module._forward_pre_hooks) == 0  # the inner forward does not put it back early
    guard.drop()
    assert len(module._forward_pre_hooks) == 1
    module._forward_pre_hooks.clear()  # the user removed every hook
    model(torch.ones(1, 2))
    assert len(module._forward_pre_hooks) == 0


def test_copies_of_a_guarded_module_are_not_guarded() -> None:
    module = nn.Linear(2, 2)
    _mistakes.guard_forward(module, "DDPStrategy", 2, _mistakes.WarnOnce())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copy.deepcopy(module)(torch.ones(1, 2))  # e.g. an EMA copy: it is not the set-up module
        pickle.loads(pickle.dumps(module))(torch.ones(1, 2))


@pytest.mark.usefixtures("no_warnings")
def test_a_correct_single_device_loop_warns_about_nothing() -> None:
    fabric = _fabric()
    module = nn.Linear(2, 1)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    for _ in range(2):
        loss = model(torch.ones(4, 2)).sum()
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
    module(torch.ones(1, 2))  # one process: the original module computes the same thing


def test_a_later_single_process_fabric_calls_a_guarded_module_through_its_own_wrapper() -> None:
    module = nn.Linear(2, 2)
    _mistakes.guard_forward(module, "DDPStrategy", 2, _mistakes.WarnOnce())  # as a 2-process setup leaves it
    model = _fabric().setup(module)  # e.g. a second Fabric that merges or fine-tunes the weights on one process
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.ones(1, 2)).sum().backward()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's own, from importing torch._dynamo
def test_the_module_inside_a_compiled_model_counts_as_set_up() -> None:
    fabric = _fabric()
    module = nn.Linear(2, 2)
    fabric.setup(torch.compile(module))
    with pytest.warns(PossibleUserWarning, match=re.escape("fabric.setup(Linear): this module was already set up")):
        fabric.setup(module)

"""Methods other than forward (training_step, marked ones) run through the strategy's wrapped forward."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from fabric import Precision
from fabric.wrappers import _FabricModule


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).sum()

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).argmax(-1)

    def describe(self) -> str:
        return "no layers run here"


class _RecordingWrapper(nn.Module):
    """Stands in for DDP: a different module around the user's, recording that it was called."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.calls = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.module(*args, **kwargs)


def _wrapped() -> tuple[_FabricModule, _RecordingWrapper, _Model]:
    model = _Model()
    wrapper = _RecordingWrapper(model)
    return _FabricModule(wrapper, model, Precision()), wrapper, model


def test_training_step_runs_through_the_wrapper_without_being_marked() -> None:
    fabric_model, wrapper, model = _wrapped()
    x = torch.randn(3, 4)
    assert torch.equal(fabric_model.training_step(x), model.layer(x).sum())
    assert wrapper.calls == 1
    assert "forward" not in model.__dict__, "the real forward is back after the call"
    assert torch.equal(fabric_model(x), model.layer(x))  # and forward itself still works
    assert wrapper.calls == 2


def test_a_marked_method_runs_through_the_wrapper() -> None:
    fabric_model, wrapper, model = _wrapped()
    fabric_model.mark_forward_method("generate")
    x = torch.randn(3, 4)
    assert torch.equal(fabric_model.generate(x), model.layer(x).argmax(-1))
    assert wrapper.calls == 1


def test_marking_by_bound_method_works_too() -> None:
    fabric_model, wrapper, model = _wrapped()
    fabric_model.mark_forward_method(model.generate)
    fabric_model.generate(torch.randn(1, 4))
    assert wrapper.calls == 1


def test_the_real_forward_comes_back_when_the_method_raises() -> None:
    fabric_model, _, model = _wrapped()
    with pytest.raises(RuntimeError):
        fabric_model.training_step(torch.randn(3, 5))  # wrong width
    assert "forward" not in model.__dict__


def test_marking_forward_or_an_unknown_name_is_refused() -> None:
    fabric_model, _, _ = _wrapped()
    with pytest.raises(ValueError, match=r"mark_forward_method\('forward'\): forward already runs through"):
        fabric_model.mark_forward_method("forward")
    with pytest.raises(AttributeError, match=r"mark_forward_method\('sample'\): _Model has no method named 'sample'"):
        fabric_model.mark_forward_method("sample")


def test_an_unmarked_method_that_runs_layers_outside_the_wrapper_warns_once() -> None:
    fabric_model, wrapper, _ = _wrapped()
    with pytest.warns(UserWarning, match=r"_Model.generate\(\) ran layers \(Linear, ...\) outside the strategy's"):
        fabric_model.generate(torch.randn(2, 4))
    assert wrapper.calls == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fabric_model.generate(torch.randn(2, 4))  # checked once per method: no cost or noise afterwards
        assert fabric_model.describe() == "no layers run here"


def test_no_warning_when_the_strategy_does_not_wrap_the_module() -> None:
    model = _Model()
    fabric_model = _FabricModule(model, model, Precision())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fabric_model.generate(torch.randn(2, 4))

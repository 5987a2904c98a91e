"""A backward that ran before the XLA runtime started breaks every later XLA backward with a bare torch assert;
the XLA strategies explain it, keeping torch's error as the cause. Runs on the fake torch_xla."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fabric import Fabric
from fabric.precision import XLAPrecision
from fabric.strategies import SingleDeviceXLAStrategy, XLAStrategy
from fabric.strategies.xla.spmd import XLASPMDStrategy

from .conftest import FakeXLA

# The shape of torch's message (torch/csrc/autograd/engine.cpp), which the fix must recognise.
TORCH_ASSERT = (
    '!device_ready_queues_.empty() INTERNAL ASSERT FAILED at "/pytorch/torch/csrc/autograd/engine.cpp":1530, '
    "please report a bug to PyTorch."
)


def _strategies() -> list[Any]:
    return [
        Fabric(accelerator="tpu", devices=1).strategy,
        Fabric(accelerator="tpu", devices="auto").strategy,
        XLASPMDStrategy(precision=XLAPrecision("32-true")),
    ]


def _failing_backward(error: Exception) -> Any:
    def backward(tensor: torch.Tensor, module: Any, *args: Any, **kwargs: Any) -> None:
        raise error

    return backward


def test_the_xla_strategies_explain_an_engine_sized_before_xla(fake_xla: FakeXLA) -> None:
    strategies = _strategies()
    assert [type(s) for s in strategies] == [SingleDeviceXLAStrategy, XLAStrategy, XLASPMDStrategy]
    for strategy in strategies:
        original = RuntimeError(TORCH_ASSERT)
        strategy.precision.backward = _failing_backward(original)
        with pytest.raises(
            RuntimeError, match=r"a backward already ran in this process before the XLA runtime"
        ) as info:
            strategy.backward(torch.ones(1), None)
        assert "Create the Fabric, or start the XLA runtime (torch_xla.device()), before any backward" in str(
            info.value
        )
        assert info.value.__cause__ is original


def test_other_backward_errors_pass_through_unchanged(fake_xla: FakeXLA) -> None:
    for strategy in _strategies():
        original = RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn")
        strategy.precision.backward = _failing_backward(original)
        with pytest.raises(RuntimeError) as info:
            strategy.backward(torch.ones(1), None)
        assert info.value is original

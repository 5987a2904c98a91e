"""DDPStrategy's per-step backward: whether it all-reduces (and so is recorded as a collective), what it passes on."""

from __future__ import annotations

import gc
import sys
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from fabric import DDPStrategy, Fabric


class _FakeDDP(nn.Module):
    """What the check reads of a DistributedDataParallel: its reducer and its sync flag (off inside no_sync)."""

    def __init__(self, syncs: bool) -> None:
        super().__init__()
        self.reducer = object()
        self.require_backward_grad_sync = syncs


def _python_calls(call: object) -> int:
    calls = 0

    def count(frame: object, event: str, arg: object) -> None:
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        call()  # type: ignore[operator]
    finally:
        sys.setprofile(None)
    return calls


def test_a_backward_without_a_model_syncs_when_any_live_model_of_the_strategy_syncs() -> None:
    strategy = DDPStrategy()
    accumulating, syncing = _FakeDDP(syncs=False), _FakeDDP(syncs=True)
    strategy._ddp_modules = [weakref.ref(accumulating)]
    assert not strategy._backward_syncs(None)  # inside no_sync: no all-reduce, nothing to record
    assert strategy._backward_syncs(syncing)  # the named model decides
    strategy._ddp_modules.append(weakref.ref(syncing))
    assert strategy._backward_syncs(None)
    del syncing
    gc.collect()
    assert not strategy._backward_syncs(None)  # a collected model is skipped, not an error
    assert not strategy._backward_syncs(nn.Linear(1, 1))  # not a DDP module


def test_the_per_step_check_is_a_plain_loop() -> None:
    strategy = DDPStrategy()
    model = _FakeDDP(syncs=True)
    strategy._ddp_modules = [weakref.ref(model)]
    # _backward_syncs alone: no WeakSet iterator, generator or per-model call frames per step.
    assert _python_calls(lambda: strategy._backward_syncs(None)) == 2  # with the lambda


def test_backward_forwards_the_gradient_and_keyword_arguments_to_torch() -> None:
    # The step skips forwarding empty star-arguments; given ones must still reach torch's backward.
    strategy, model = DDPStrategy(), _FakeDDP(syncs=True)
    weight = torch.ones(3, requires_grad=True)
    out = weight * 2
    strategy.backward(out, model, torch.full((3,), 3.0), retain_graph=True)  # the gradient, positionally
    assert torch.equal(weight.grad, torch.full((3,), 6.0))
    strategy.backward(out.sum(), model)  # possible only because the graph was retained
    assert torch.equal(weight.grad, torch.full((3,), 8.0))
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        strategy.backward(out.sum(), model)


def test_fabric_backward_passes_arguments_through_only_when_given() -> None:
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    calls: list[tuple[Any, ...]] = []
    fabric._strategy.backward = lambda *args, **kwargs: calls.append((args, kwargs))  # type: ignore[method-assign]
    fabric._backward_checked = True  # no model set up here; the check is tested elsewhere
    loss, gradient = torch.tensor(1.0), torch.tensor(2.0)
    fabric.backward(loss)
    fabric.backward(loss, gradient, retain_graph=True)
    assert calls == [((loss, None), {}), ((loss, None, gradient), {"retain_graph": True})]

"""DDPStrategy's per-step backward: when fabric calls torch's backward itself, what it counts, what it passes on."""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _one_process import one_process
from torch import nn

from fabric import DDPStrategy, Fabric
from fabric.diagnostics import track
from fabric.diagnostics.record import Collective
from fabric.precision.precision import Precision


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


class _ScalingPrecision(Precision):
    """A precision whose backward adds something (as a loss scaler does): fabric.backward must go through it."""

    def backward(self, tensor: Any, model: Any, *args: Any, **kwargs: Any) -> None:
        super().backward(tensor * 2, model, *args, **kwargs)


class _OwnBackward(DDPStrategy):
    def backward(self, tensor: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        super().backward(tensor, module, *args, **kwargs)


@pytest.mark.parametrize(
    ("strategy", "fast"),
    [
        (DDPStrategy(), True),
        (DDPStrategy(precision=_ScalingPrecision()), False),
        (_OwnBackward(), False),
    ],
    ids=["plain", "precision with its own backward", "strategy subclass with its own backward"],
)
def test_fabric_calls_torchs_backward_itself_only_where_nothing_else_runs(strategy: DDPStrategy, fast: bool) -> None:
    assert strategy._fast_backward() == (fast, None)  # no process group: nothing counts


def test_debug_mode_sends_the_backward_through_the_strategy(monkeypatch: pytest.MonkeyPatch) -> None:
    class Recorder:
        debug, backwards = True, 0

    monkeypatch.setattr(track, "_LAST", [lambda: None, Recorder()])
    monkeypatch.setattr(track, "_recorder", lambda group: track._LAST[1])
    plain, counter = DDPStrategy()._fast_backward()
    assert not plain and counter is track._LAST[1], "entered and compared across ranks, not only counted"


@pytest.fixture
def one_rank_ddp() -> Iterator[Fabric]:
    yield from one_process("ddp")


def test_a_ddp_backward_is_torchs_backward_and_a_count(one_rank_ddp: Fabric) -> None:
    fabric = one_rank_ddp
    model = fabric.setup(nn.Linear(2, 2))  # collective #1: DDP broadcasts rank 0's weights
    counter = track.backward_counter()
    assert counter is not None
    x = torch.ones(3, 2)
    fabric.backward(model(x).sum())  # #2, counted
    assert fabric._plain_backward and counter.backwards == 1
    # Per step, fabric.backward adds its own frame and nothing else: every other call is torch's, as without it.
    raw_loss, fabric_loss = model(x).sum(), model(x).sum()
    raw = _python_calls(lambda: raw_loss.backward())
    assert _python_calls(lambda: fabric.backward(fabric_loss)) == raw + 1
    assert counter.backwards == 2, "the raw loss.backward() above is not fabric's to count"
    with fabric.no_backward_sync(model):
        fabric.backward(model(x).sum())  # #4: counted in every mode, so the numbers agree across modes
    line = sys._getframe().f_lineno + 1
    fabric.all_reduce(torch.ones(1))
    last, inside = counter.snapshot()
    assert (last, inside) == (Collective(5, "all_reduce", f"test_ddp.py:{line}"), False)


def test_the_fast_path_forwards_the_gradient_and_keyword_arguments_to_torch(one_rank_ddp: Fabric) -> None:
    model = one_rank_ddp.setup(nn.Linear(2, 1, bias=False))
    out = model(torch.ones(3, 2))
    one_rank_ddp.backward(out, torch.full((3, 1), 2.0), retain_graph=True)  # the gradient, positionally
    assert one_rank_ddp._plain_backward
    assert torch.equal(model.module.weight.grad, torch.full((1, 2), 6.0))
    one_rank_ddp.backward(out.sum())  # possible only because the graph was retained
    assert torch.equal(model.module.weight.grad, torch.full((1, 2), 9.0))


def test_fabric_backward_passes_arguments_to_the_strategy_only_when_given() -> None:
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    calls: list[tuple[Any, ...]] = []
    fabric._strategy.backward = lambda *args, **kwargs: calls.append((args, kwargs))  # type: ignore[method-assign]
    fabric._backward_checked = True  # the strategy's path (the fast one is decided at the first backward)
    loss, gradient = torch.tensor(1.0), torch.tensor(2.0)
    fabric.backward(loss)
    fabric.backward(loss, gradient, retain_graph=True)
    assert calls == [((loss, None), {}), ((loss, None, gradient), {"retain_graph": True})]

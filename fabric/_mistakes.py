"""Mistakes that PyTorch and Lightning Fabric accept without a word, turned into clear errors or one-time warnings.

Each check here guards a case that trains wrongly rather than failing: an optimizer that never changes the model
it was set up with, objects set up twice, forward calls that go around the strategy's wrapper, and backward under
several processes with no set-up model (a warning). All records are per Fabric object (no process-wide state).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.nn import Module

from fabric._forward_methods import _ForwardGuard
from fabric._setup import check_not_wrapped
from fabric.utilities.exceptions import FabricTypeError, FabricValueError
from fabric.utilities.warnings import PossibleUserWarning
from fabric.wrappers import _uncompiled


class WarnOnce:
    """The warnings one Fabric object has given: each key warns once per Fabric, not once per process."""

    def __init__(self) -> None:
        self._given: set[str] = set()

    def __call__(self, key: str, message: str, category: type[Warning] = UserWarning, stacklevel: int = 2) -> None:
        """Warn with `message` unless this Fabric already warned under `key`; `stacklevel` counts from the caller."""
        if key in self._given:
            return
        self._given.add(key)
        warnings.warn(message, category, stacklevel=stacklevel + 1)


class SetupRecord:
    """Which modules and optimizers this Fabric has set up, by identity, without keeping them alive."""

    def __init__(self) -> None:
        # id -> weak reference; the identity check on lookup guards against an id reused after garbage collection.
        self._modules: dict[int, weakref.ref] = {}
        self._optimizers: dict[int, weakref.ref] = {}

    @property
    def has_modules(self) -> bool:
        """Whether any module set up by this Fabric is still alive."""
        return any(ref() is not None for ref in self._modules.values())

    def add_module(self, module: Module) -> None:
        """Remember a set-up module (the user's, inside any torch.compile wrapper)."""
        _remember(self._modules, _uncompiled(module))

    def add_optimizers(self, optimizers: Iterable[Any]) -> None:
        """Remember set-up optimizers."""
        for optimizer in optimizers:
            _remember(self._optimizers, optimizer)

    def check_new_module(
        self, method: str, module: Any, strategy: Any = None, warn_once: WarnOnce | None = None
    ) -> None:
        """A module, not a wrapper fabric returned; the module inside one this Fabric returned only where `strategy`
        can set it up again correctly (then with a warning, as Lightning Fabric allows it)."""
        check_module(module, method)
        check_not_wrapped(module, method)
        if not _known(self._modules, _uncompiled(module)):
            return
        name = type(module).__name__
        if strategy is not None and strategy.repeatable_module_setup and warn_once is not None:
            warn_once(
                "module-set-up-again",
                f"fabric.{method}({name}): this module was already set up by this Fabric, and is now wrapped a "
                f"second time, as Lightning Fabric does. Both wrappers share the weights and {type(strategy).__name__} "
                "keeps training correct (under DDP each wrapper synchronises the gradients of its own forward "
                "calls), but two wrappers are easy to mix up. Keep using one model; to set up an optimizer created "
                "later, call fabric.setup_optimizers(optimizer) instead.",
                PossibleUserWarning,
                stacklevel=4,
            )
            return
        strategy_name = type(strategy).__name__ if strategy is not None else "the strategy"
        raise FabricValueError(
            f"fabric.{method}({name}): this module was already set up by this Fabric, which returned a wrapper for "
            f"it. {strategy_name} changes the module itself when it sets it up (it shards it, or hands it to its "
            "engine), so setting it up again would prepare it twice and train wrongly without an error. Keep using "
            "the model that the first setup returned; to set up an optimizer created later, call "
            "fabric.setup_optimizers(optimizer)."
        )

    def check_new_optimizers(self, method: str, optimizers: Sequence[Any]) -> None:
        """Optimizers, none a wrapper fabric returned, none passed twice or set up before by this Fabric."""
        for optimizer in optimizers:
            check_not_wrapped(optimizer, method)
        check_optimizers(optimizers, method)
        seen: set[int] = set()
        for optimizer in optimizers:
            name = type(optimizer).__name__
            if id(optimizer) in seen:
                raise FabricValueError(
                    f"fabric.{method}(..., {name}, {name}): the same optimizer was passed twice, so each "
                    "optimizer.step() would update the parameters twice. Pass each optimizer once."
                )
            seen.add(id(optimizer))
            if _known(self._optimizers, optimizer):
                raise FabricValueError(
                    f"fabric.{method}(..., {name}): this optimizer was already set up by this Fabric. Setting it up "
                    "again would make two wrappers step the same parameters. Keep using the optimizer that the "
                    "first setup returned."
                )


def _remember(table: dict[int, weakref.ref], obj: Any) -> None:
    # An object without weak reference support cannot be tracked; it is then not checked.
    with contextlib.suppress(TypeError):
        table[id(obj)] = weakref.ref(obj)


def _known(table: dict[int, weakref.ref], obj: Any) -> bool:
    ref = table.get(id(obj))
    return ref is not None and ref() is obj


# -- argument types -------------------------------------------------------------------------------------------
def check_module(obj: Any, method: str) -> None:
    """A model argument must be a torch.nn.Module (a string or None here usually means a mixed-up call)."""
    if not isinstance(obj, Module):
        raise FabricTypeError(
            f"fabric.{method}({_show(obj)}): expected your model, a torch.nn.Module, as the first argument, but got "
            f"{type(obj).__name__}. Pass the model object: fabric.{method}(model"
            f"{', optimizer' if method == 'setup' else ''})."
        )


def check_optimizers(optimizers: Sequence[Any], method: str) -> None:
    """Every optimizer argument must be an optimizer; an LR scheduler passed positionally gets its own advice."""
    for obj in optimizers:
        if callable(getattr(obj, "step", None)) and isinstance(getattr(obj, "param_groups", None), list):
            continue
        if isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer):
            raise FabricTypeError(
                f"fabric.{method}(..., {type(obj).__name__}): this looks like an LR scheduler, passed where an "
                "optimizer goes. Pass it by keyword: fabric.setup(model, optimizer, scheduler=scheduler)."
            )
        raise FabricTypeError(
            f"fabric.{method}(..., {_show(obj)}): expected a torch.optim.Optimizer, but got {type(obj).__name__}. "
            "Create the optimizer over your model's parameters first, e.g. torch.optim.SGD(model.parameters(), "
            "lr=0.1), and pass that object."
        )


def check_loss(tensor: Any) -> None:
    """`fabric.backward` needs the loss tensor (None often means a step function returned nothing)."""
    if not isinstance(tensor, torch.Tensor):
        raise FabricTypeError(
            f"fabric.backward({_show(tensor)}): expected the loss, a torch.Tensor, but got {type(tensor).__name__}. "
            "Pass the tensor your loss function returned (check that your step function returns it)."
        )


def check_loggers(loggers: list[Any]) -> None:
    """Fabric calls `log_metrics` on each logger; anything else would fail only at the first fabric.log."""
    for logger in loggers:
        if isinstance(logger, type) or not callable(getattr(logger, "log_metrics", None)):
            what = f"the class {logger.__name__}" if isinstance(logger, type) else _show(logger)
            raise FabricTypeError(
                f"Fabric(loggers=[{what}]): not a logger instance; fabric calls log_metrics() on each logger. "
                "Pass logger objects, e.g. loggers=[CSVLogger('logs')] or TensorBoardLogger('logs')."
            )


def _show(obj: Any) -> str:
    if isinstance(obj, (str, type(None), int, float, bool)):
        return repr(obj)
    return type(obj).__name__


# -- optimizer parameters against the model ------------------------------------------------------------------
def check_optimizer_params(
    module: Module, optimizers: Sequence[Any], world_size: int, strategy: str, warn_once: WarnOnce
) -> None:
    """An optimizer set up with a model must step that model's parameters.

    None of them in the model: its steps never change the model (usually it was built over another instance),
    an error, unless the model has nothing to train (an optimizer over an input image is legitimate). Some in and
    some out: fine on one process (learnable loss weights), but with several processes the strategy averages only
    the model's gradients, so the outside parameters drift apart across ranks: a warning, as a user may average
    them by hand.
    """
    in_model = {id(p) for p in module.parameters()}
    trainable = any(p.requires_grad for p in module.parameters())
    for optimizer in optimizers:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        outside = [p for p in params if id(p) not in in_model]
        if not outside:
            continue
        name = type(optimizer).__name__
        if len(outside) == len(params) and trainable:
            raise FabricValueError(
                f"fabric.setup({type(module).__name__}, ..., {name}): none of the optimizer's {len(params)} "
                "parameters belongs to the model it was passed with, so its steps would never change that model "
                "(it was probably created over another instance, or before the model was re-created). Create the "
                "optimizer from this model's parameters: torch.optim.SGD(model.parameters(), ...). If it is meant "
                "to train something else, set the model up with fabric.setup_module(model) and the optimizer with "
                "fabric.setup_optimizers(optimizer)."
            )
        if world_size > 1 and len(outside) < len(params):
            shapes = ", ".join(str(list(p.shape)) for p in outside[:3])
            warn_once(
                "optimizer-params-outside",
                f"fabric.setup({type(module).__name__}, ..., {name}): {len(outside)} of the optimizer's "
                f"parameters (shapes {shapes}{', ...' if len(outside) > 3 else ''}) are not in the model. "
                f"{strategy} averages only the model's gradients across the {world_size} processes, so these "
                "parameters get different updates on each process and drift apart. Make them attributes of the "
                "model (an nn.Parameter on the module), or average their gradients yourself with "
                "fabric.all_reduce before optimizer.step().",
                PossibleUserWarning,
                stacklevel=3,
            )


# -- forward calls that go around the strategy's wrapper ------------------------------------------------------
def guard_forward(module: Module, strategy: str, world_size: int, warn_once: WarnOnce) -> _ForwardGuard:
    """Watch `module` (the object the user passed to setup) for forward calls that do not come through the wrapper.

    One forward pre-hook on the root module only, which the wrapper's forward lifts while it runs (see
    `_ForwardGuard`): calls through the wrapper keep torch's hook-free fast path and pay two dictionary operations.
    Without gradients nothing can drift, so inference on the original module (evaluation, under torch.no_grad)
    stays silent.
    """
    guard = _ForwardGuard()
    message = (
        f"{type(module).__name__}.forward() was called on the module you passed to fabric.setup(), not on the "
        f"model fabric.setup() returned, while gradients are enabled. That call bypasses {strategy}, so its "
        f"gradients are not averaged across the {world_size} processes and the weights drift apart. Call the "
        "returned model instead (model = fabric.setup(model)); for other methods that run the model, use "
        "model.mark_forward_method('name'); for inference on the original module, wrap the call in torch.no_grad()."
    )
    # A possible user warning: a few call the original module on purpose (say, for gradients with respect to the
    # inputs only, as in adversarial training), and may silence it by its category.
    hook = _UnwrappedForwardHook(guard, lambda: warn_once("unwrapped-forward", message, PossibleUserWarning, 6))
    handle = module.register_forward_pre_hook(hook)
    guard.watch(module._forward_pre_hooks, handle.id, hook)
    return guard


def existing_guard(module: Module) -> _ForwardGuard | None:
    """The guard an earlier setup (of any Fabric) put on `module`: every later wrapper of it must raise it too, or
    its own calls would look like calls around the first wrapper."""
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, _UnwrappedForwardHook) and hook._guard is not None:
            return hook._guard
    return None


class _UnwrappedForwardHook:
    """The pre-hook of `guard_forward`; a copy or pickle of the module gets a disabled one (it is not set up)."""

    def __init__(self, guard: _ForwardGuard | None, warn: Callable[[], None] | None) -> None:
        self._guard = guard
        self._warn = warn

    def __call__(self, module: Module, args: Any) -> None:
        guard = self._guard
        if guard is not None and guard.depth == 0 and torch.is_grad_enabled() and self._warn is not None:
            self._warn()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _UnwrappedForwardHook, (None, None)


def check_backward_has_model(has_modules: bool, world_size: int, strategy: str) -> None:
    """With several processes, a loss from a model this Fabric never set up gets gradients it does not synchronise.

    A warning, not an error, as in Lightning Fabric (which says nothing): the model may be set up by another Fabric,
    or its gradients averaged by hand (sheeprl does both). Fabric.backward asks once per Fabric object.
    """
    if world_size > 1 and not has_modules:
        warnings.warn(
            f"fabric.backward(): no model was set up with this Fabric, but {strategy} runs {world_size} processes. "
            "This Fabric does not average the gradients of a model it did not set up: unless another Fabric set "
            "the model up or you average its gradients yourself (fabric.all_reduce before optimizer.step()), the "
            "processes' weights drift apart. Set the model up first: model, optimizer = fabric.setup(model, "
            "optimizer), and compute the loss with the returned model.",
            PossibleUserWarning,
            stacklevel=3,
        )


def check_clip_limits(clip_val: Any, max_norm: Any) -> None:
    """Exactly one limit, and a positive one: zero or a negative limit would zero or flip every gradient."""
    if (clip_val is None) == (max_norm is None):
        raise FabricValueError(
            f"fabric.clip_gradients(clip_val={clip_val}, max_norm={max_norm}): pass exactly one of them: "
            "clip_val clamps each gradient value, max_norm rescales the total gradient norm."
        )
    name, value = ("max_norm", max_norm) if max_norm is not None else ("clip_val", clip_val)
    if not value > 0:  # also refuses NaN
        effect = f"set every gradient to {value}" if name == "clip_val" else "zero every gradient (flip it, if < 0)"
        raise FabricValueError(
            f"fabric.clip_gradients({name}={value}): the limit must be a positive number; this one would {effect} "
            f"instead of limiting them. Pass a positive {name}, e.g. {name}=1.0 (or leave out clip_gradients)."
        )

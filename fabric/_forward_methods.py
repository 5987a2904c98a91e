"""Running a module's other methods (training_step, generate, ...) through the strategy's wrapped forward.

DDP, DeepSpeed and FSDP do their work (gradient sync hooks, gathering shards) when the *wrapped* module is called.
A method such as `model.training_step(batch)` is looked up on the user's module, so without routing it would run
outside that wrapper: under DDP its gradients would silently not be averaged across processes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from torch.nn import Module

from fabric.utilities.exceptions import FabricValueError

# Routed automatically when the user's module defines them: the names Lightning users already write.
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
_MISSING = object()


class _ForwardGuard:
    """How deep a wrapper's forward is running; the original module's forward outside it goes around the strategy.

    The watch is a forward pre-hook on the user's module (see `_mistakes.guard_forward`). Any hook on a module
    turns off the fast path of torch's `Module.__call__` (about 3 us per call), and the wrapper's own forward
    reaches that module too (DDP calls it). So while a wrapper's forward runs, the hook is taken out of the
    module's hook table and put back after: the set-up model's calls run as fast as raw torch's, and the module
    is watched whenever no wrapper is running, which is when a call to it goes around the strategy.
    """

    # Public to `_FabricModule.__call__`, which inlines `call` (a Python frame costs microseconds in a small step).
    __slots__ = ("depth", "hook", "hooks", "key")

    def __init__(self) -> None:
        self.depth = 0
        # The module's pre-hook table, our hook's key in it and the hook, once `watch` is called.
        self.hooks: dict[int, Any] | None = None
        self.key = -1
        self.hook: Any = None

    def watch(self, hooks: dict[int, Any], key: int, hook: Any) -> None:
        """Remember the hook (`hooks[key]`) to lift while a wrapper's forward runs."""
        self.hooks, self.key, self.hook = hooks, key, hook

    def lift(self) -> None:
        """A wrapper's forward starts: calls of the module now come through the strategy."""
        self.depth += 1
        if self.depth == 1 and self.hooks is not None:
            # None when the user removed the hook meanwhile: then `drop` does not put it back either.
            self.hook = self.hooks.pop(self.key, None)

    def drop(self) -> None:
        """A wrapper's forward ends: watch the module again (the hook only warns, so its place in the table,
        now the last, does not matter)."""
        self.depth -= 1
        if self.depth == 0 and self.hook is not None and self.hooks is not None:
            self.hooks[self.key] = self.hook

    def call(self, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`forward(*args, **kwargs)` (the strategy's module) with the guard lifted meanwhile."""
        self.lift()
        try:
            return forward(*args, **kwargs)
        finally:
            self.drop()


def default_forward_methods(module: Module) -> set[str]:
    """The step methods `module` defines, which are routed through the wrapped forward without being marked."""
    return {name for name in STEP_METHODS if callable(getattr(type(module), name, None))}


def check_markable(module: Module, name: str) -> None:
    """Refuse names that cannot be routed, with the reason."""
    if name == "forward":
        raise FabricValueError(
            "mark_forward_method('forward'): forward already runs through the strategy. Mark your other methods, "
            "such as 'generate'."
        )
    if not callable(getattr(module, name, None)):
        raise AttributeError(
            f"mark_forward_method({name!r}): {type(module).__name__} has no method named {name!r}. Pass the name "
            "of a method defined on the module you gave to fabric.setup()."
        )


def call_through_forward(wrapper_forward: Callable[..., Any], module: Module, name: str, *args: Any, **kw: Any) -> Any:
    """Call `module.<name>(*args)` as if it were `forward`, so the strategy's wrapper runs around it.

    For this one call the module's `forward` is replaced by a function that puts the real forward back and then
    runs the method, so calls to `self(...)` inside the method reach the real forward.
    """
    method = getattr(module, name)
    saved = module.__dict__.get("forward", _MISSING)

    def restore() -> None:
        if saved is _MISSING:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = saved

    def forward_once(*inner_args: Any, **inner_kwargs: Any) -> Any:
        restore()
        return method(*inner_args, **inner_kwargs)

    module.__dict__["forward"] = forward_once
    try:
        return wrapper_forward(*args, **kw)
    finally:
        restore()


def tracked(
    module: Module, name: str, method: Callable[..., Any], done: set[str], guard: _ForwardGuard | None = None
) -> Callable[..., Any]:
    """`method`, which warns (once per name) if it runs the module's layers outside the strategy's wrapper.

    `guard` (the wrapper's, if it has one) is raised meanwhile: this warning, which names the method, stands in for
    the general one about calling the original module's forward.
    """

    def call(*args: Any, **kwargs: Any) -> Any:
        done.add(name)
        bypassed: list[str] = []
        hooks = [m.register_forward_pre_hook(lambda m, _: bypassed.append(type(m).__name__)) for m in module.modules()]
        if guard is not None:
            guard.lift()
        try:
            return method(*args, **kwargs)
        finally:
            if guard is not None:
                guard.drop()
            for hook in hooks:
                hook.remove()
            if bypassed:
                warnings.warn(
                    f"{type(module).__name__}.{name}() ran layers ({bypassed[0]}, ...) outside the strategy's wrapped "
                    "forward, so the strategy did not see them (under DDP their gradients are not averaged across "
                    f"processes). Call model.mark_forward_method({name!r}) after fabric.setup() to route it "
                    "through the wrapper, or compute inside forward().",
                    stacklevel=2,
                )

    return call

"""Calling a hook on every callback that defines it, each with the keyword arguments its method accepts."""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Iterable
from typing import Any


def accepted_kwargs(method: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The entries of `kwargs` that `method` names as parameters; all of them when it takes **kwargs.

    Callbacks written for different versions of a hook (say with and without a `fabric=` argument) can then share
    one `fabric.call`. A method whose signature cannot be read gets everything.
    """
    if not kwargs:
        return kwargs
    # A bound method is a new object on every lookup; its function is not, so the signature is read once.
    function = getattr(method, "__func__", None)
    names = _names_of(function) if function is not None else _read_names(method)
    if names is None:
        return kwargs
    return {name: value for name, value in kwargs.items() if name in names}


@functools.lru_cache(maxsize=256)
def _names_of(function: Callable[..., Any]) -> frozenset[str] | None:
    return _read_names(function, bound=True)


def _read_names(method: Callable[..., Any], bound: bool = False) -> frozenset[str] | None:
    """The parameter names `method` accepts by keyword; None when it takes **kwargs or has no readable signature.

    `bound`: `method` is the function of a bound method, whose first parameter (self) the binding supplies.
    """
    try:
        parameters = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        return None
    if bound and parameters and parameters[0].kind is not inspect.Parameter.VAR_POSITIONAL:
        parameters = parameters[1:]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in parameters if p.kind in by_name)


def call_hook(callbacks: Iterable[Any], hook_name: str, args: tuple, kwargs: dict[str, Any]) -> None:
    """Call `hook_name` on each callback that has it; warn about (and skip) an attribute that is not callable."""
    for callback in callbacks:
        method = getattr(callback, hook_name, None)
        if method is None:
            continue
        if not callable(method):
            warnings.warn(
                f"fabric.call({hook_name!r}): {type(callback).__name__}.{hook_name} is not callable "
                f"({type(method).__name__}), so it was skipped. Make it a method, or rename the attribute.",
                stacklevel=3,
            )
            continue
        method(*args, **accepted_kwargs(method, kwargs))

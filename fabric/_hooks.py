"""Calling a hook on every callback that defines it, each with the keyword arguments its method accepts."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterable
from typing import Any


def accepted_kwargs(method: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The entries of `kwargs` that `method` names as parameters; all of them when it takes **kwargs.

    Callbacks written for different versions of a hook (say with and without a `fabric=` argument) can then share
    one `fabric.call`. A method whose signature cannot be read gets everything.
    """
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return kwargs
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = {p.name for p in parameters if p.kind in by_name}
    return {name: value for name, value in kwargs.items() if name in names}


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

"""Skipping weight initialisation when a model is built only to be loaded or sharded afterwards."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.overrides import TorchFunctionMode


class _EmptyInit(TorchFunctionMode):
    """Turns `torch.nn.init.*` calls into no-ops while enabled, so large models build quickly."""

    def __init__(self, enabled: bool = True) -> None:
        super().__init__()
        self.enabled = enabled

    def __enter__(self) -> Any:
        # A disabled mode must not be pushed at all: an active mode costs every torch call a detour.
        return super().__enter__() if self.enabled else self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            super().__exit__(*exc)

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            # Every in-place init function takes the tensor first and returns it.
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)

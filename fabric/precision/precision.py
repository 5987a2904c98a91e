"""The Precision role: numeric policy. The base class is full precision (`32-true`)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer


class Precision:
    """`32-true`: every hook is the identity; subclasses change only what they need."""

    precision: str = "32-true"
    # Whether convert_input / convert_output / forward_context do anything; lets wrappers skip them.
    changes_forward: bool = False

    def convert_module(self, module: Module) -> Module:
        """Change the module's parameters to this policy's dtype."""
        return module

    def module_init_context(self) -> AbstractContextManager:
        """Context in which new modules are created with this policy's dtype."""
        return self.tensor_init_context()

    def tensor_init_context(self) -> AbstractContextManager:
        """Context in which new tensors get this policy's default dtype."""
        return nullcontext()

    def forward_context(self) -> AbstractContextManager:
        """Context around the forward pass (autocast for mixed precision)."""
        return nullcontext()

    def convert_input(self, data: Any) -> Any:
        """Convert floating-point inputs before the forward pass."""
        return data

    def convert_output(self, data: Any) -> Any:
        """Convert floating-point outputs after the forward pass."""
        return data

    @property
    def requires_fabric_backward(self) -> bool:
        """True when a plain `loss.backward()` would be wrong (e.g. the loss must be scaled)."""
        return False

    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """Run the backward pass for `tensor`."""
        tensor.backward(*args, **kwargs)

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Step the optimizer."""
        return optimizer.step(**kwargs)

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Divide gradients by the loss scale, if any, before clipping."""

    @property
    def has_loss_scaler(self) -> bool:
        """Whether gradients may legitimately be inf/nan (the scaler then skips the step)."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """State to put in checkpoints (the loss scaler's, for example)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""

    def teardown(self) -> None:
        """Undo process-wide changes."""


class _DefaultDtype(AbstractContextManager):
    """Temporarily changes torch's default floating-point dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        self._dtype = dtype
        self._previous = torch.get_default_dtype()

    def __enter__(self) -> None:
        self._previous = torch.get_default_dtype()
        torch.set_default_dtype(self._dtype)

    def __exit__(self, *exc: object) -> None:
        torch.set_default_dtype(self._previous)


def _convert_floating(data: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in a collection to `dtype`."""
    from fabric.utilities.apply_func import apply_to_collection

    def cast(tensor: Tensor) -> Tensor:
        return tensor.to(dtype) if torch.is_floating_point(tensor) else tensor

    return apply_to_collection(data, Tensor, cast)

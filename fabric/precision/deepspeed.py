"""DeepSpeed's numeric policy: the engine casts the model and keeps float32 master weights; inputs follow it."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import torch
from torch import Tensor
from torch.nn import Module

from fabric.precision.precision import Precision, _convert_floating, _DefaultDtype
from fabric.utilities.exceptions import FabricValueError

_DTYPES = {
    "32-true": torch.float32,
    "16-mixed": torch.float16,
    "16-true": torch.float16,
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
}
# The section of DeepSpeed's config each precision enables (None: plain float32).
_SECTIONS = {"32-true": None, "16-mixed": "fp16", "16-true": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16"}


class DeepSpeedPrecision(Precision):
    """The precision of a DeepSpeed run; the strategy turns it into the config's `fp16` / `bf16` section.

    DeepSpeed itself casts the model to the 16-bit dtype and scales the float16 loss, so there is no autocast:
    this plugin only casts floating-point inputs to the model's dtype and outputs back to the default dtype.
    `*-true` also creates modules and tensors directly in the 16-bit dtype under `fabric.init_module()`.
    """

    def __init__(self, precision: Literal["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"]) -> None:
        if precision not in _DTYPES:
            raise FabricValueError(
                f"DeepSpeedPrecision(precision={precision!r}): DeepSpeed cannot train in this precision. Use one "
                f"of {', '.join(_DTYPES)}."
            )
        self.precision = precision
        self.dtype = _DTYPES[precision]
        self.changes_forward = precision != "32-true"

    @property
    def config_section(self) -> str | None:
        """'fp16', 'bf16' or None: the section of DeepSpeed's config this precision enables."""
        return _SECTIONS[self.precision]

    @property
    def requires_fabric_backward(self) -> bool:
        """Always: only the engine's backward reduces ZeRO's gradients (and scales a float16 loss)."""
        return True

    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """Back-propagate through the DeepSpeed engine `module` (`module.backward(tensor)`), as Lightning does."""
        if module is None:
            raise FabricValueError(
                "DeepSpeedPrecision.backward(tensor, None): only the DeepSpeed engine can back-propagate (it scales "
                "the loss and reduces ZeRO's gradients). Pass the engine that computed the loss."
            )
        engine: Any = module  # a DeepSpeedEngine; nn.Module does not declare its backward
        engine.backward(tensor, *args, **kwargs)

    def convert_module(self, module: Module) -> Module:
        """`*-true` casts the model now; for `*-mixed` the engine casts it and keeps float32 master weights."""
        if self.precision.endswith("-true"):
            return module.to(dtype=self.dtype)
        return module

    def tensor_init_context(self) -> AbstractContextManager:
        """`*-true`: new tensors default to the 16-bit dtype; otherwise they are created in float32."""
        if self.precision.endswith("-true") and self.dtype != torch.float32:
            return _DefaultDtype(self.dtype)
        return nullcontext()

    def convert_input(self, data: Any) -> Any:
        """Float inputs take the dtype of the engine's parameters."""
        return _convert_floating(data, self.dtype)

    def convert_output(self, data: Any) -> Any:
        """Outputs go back to the default dtype for the loss and metrics."""
        return _convert_floating(data, torch.get_default_dtype())

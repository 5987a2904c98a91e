"""`16-true` and `bf16-true`: parameters and computation entirely in a 16-bit dtype."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
from torch.nn import Module

from fabric.precision.precision import Precision, _convert_floating, _DefaultDtype
from fabric.utilities.exceptions import FabricValueError


class HalfPrecision(Precision):
    """Pure half or bfloat16 precision, no autocast and no loss scaling."""

    changes_forward = True

    def __init__(self, precision: Literal["16-true", "bf16-true"] = "16-true") -> None:
        if precision not in ("16-true", "bf16-true"):
            raise FabricValueError(
                f"HalfPrecision(precision={precision!r}): unsupported value. Use '16-true' or 'bf16-true'."
            )
        self.precision = precision
        self._dtype = torch.bfloat16 if precision == "bf16-true" else torch.float16

    def convert_module(self, module: Module) -> Module:
        """Cast parameters and buffers to the 16-bit dtype."""
        return module.to(dtype=self._dtype)

    def tensor_init_context(self) -> AbstractContextManager:
        """New tensors default to the 16-bit dtype."""
        return _DefaultDtype(self._dtype)

    def forward_context(self) -> AbstractContextManager:
        """Tensors created during forward default to the 16-bit dtype."""
        return _DefaultDtype(self._dtype)

    def convert_input(self, data: Any) -> Any:
        """Float inputs become 16-bit so they match the parameters."""
        return _convert_floating(data, self._dtype)

    def convert_output(self, data: Any) -> Any:
        """Outputs go back to the default dtype for the loss and metrics."""
        return _convert_floating(data, torch.get_default_dtype())

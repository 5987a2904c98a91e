"""`64-true`: parameters, inputs and new tensors in float64."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.nn import Module

from fabric.precision.precision import Precision, _convert_floating, _DefaultDtype


class DoublePrecision(Precision):
    """Everything in double precision."""

    precision = "64-true"
    changes_forward = True

    def convert_module(self, module: Module) -> Module:
        """Cast parameters and buffers to float64."""
        return module.double()

    def tensor_init_context(self) -> AbstractContextManager:
        """New tensors default to float64."""
        return _DefaultDtype(torch.float64)

    def forward_context(self) -> AbstractContextManager:
        """Tensors created during forward default to float64."""
        return _DefaultDtype(torch.float64)

    def convert_input(self, data: Any) -> Any:
        """Float inputs become float64."""
        return _convert_floating(data, torch.float64)

    def convert_output(self, data: Any) -> Any:
        """Outputs go back to the default dtype the user's code expects."""
        return _convert_floating(data, torch.get_default_dtype())

"""Lightning Fabric's import path ``plugins.precision.utils``: the dtype helpers client precision plugins import."""

from __future__ import annotations

import torch
from torch import Tensor

from fabric.precision.precision import _DefaultDtype as _DtypeContextManager


def _convert_fp_tensor(tensor: Tensor, dst_type: str | torch.dtype) -> Tensor:
    """`tensor` cast to `dst_type` if it is floating point; any other tensor unchanged."""
    return tensor.to(dst_type) if torch.is_floating_point(tensor) else tensor


__all__ = ["_DtypeContextManager", "_convert_fp_tensor"]

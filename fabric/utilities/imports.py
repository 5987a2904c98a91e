"""Version and platform flags under the names Lightning Fabric code checks (``_TORCH_GREATER_EQUAL_2_3``, ...)."""

from __future__ import annotations

import importlib.util
import platform
import sys

import torch


def _torch_version() -> tuple[int, int, int]:
    # "2.13.0+cpu" or "2.14.0a0+git1234": the numeric release part is what the flags compare.
    parts = torch.__version__.split("+")[0].split(".")[:3]
    numbers = [int("".join(ch for ch in part if ch.isdigit()) or 0) for part in parts]
    major, minor, patch = [*numbers, 0, 0, 0][:3]
    return major, minor, patch


_TORCH = _torch_version()
_NUMPY_AVAILABLE = importlib.util.find_spec("numpy") is not None
_IS_WINDOWS = platform.system() == "Windows"
_IS_INTERACTIVE = hasattr(sys, "ps1") or bool(sys.flags.interactive)
_PYTHON_GREATER_EQUAL_3_10_0 = sys.version_info >= (3, 10)
# Always true (torch >= 2.13 is required); Lightning's older flags, still imported by client code.
_TORCH_GREATER_EQUAL_2_0 = _TORCH >= (2, 0, 0)
_TORCH_GREATER_EQUAL_2_1 = _TORCH >= (2, 1, 0)
_TORCH_GREATER_EQUAL_2_2 = _TORCH >= (2, 2, 0)
_TORCH_GREATER_EQUAL_2_3 = _TORCH >= (2, 3, 0)
_TORCH_GREATER_EQUAL_2_4 = _TORCH >= (2, 4, 0)
_TORCH_GREATER_EQUAL_2_4_1 = _TORCH >= (2, 4, 1)
_TORCH_GREATER_EQUAL_2_5 = _TORCH >= (2, 5, 0)
_TORCH_GREATER_EQUAL_2_6 = _TORCH >= (2, 6, 0)
_TORCH_EQUAL_2_4_0 = _TORCH == (2, 4, 0)
_TORCH_LESS_EQUAL_2_6 = _TORCH <= (2, 6, 0)

"""Lightning's GPU-id parsing helpers, over fabric's own `devices` parsing (fabric.accelerators._devices)."""

from __future__ import annotations

from typing import Any

import torch

from fabric.accelerators._devices import parse_device_indices
from fabric.utilities.exceptions import FabricValueError
from fabric.utilities.types import _DEVICE


def _determine_root_gpu_device(gpus: list[_DEVICE] | None) -> _DEVICE | None:
    """The first of the selected GPUs (the one rank 0 of a node uses), or None when none are selected."""
    if gpus is None:
        return None
    if not isinstance(gpus, list) or not gpus:
        raise FabricValueError(f"_determine_root_gpu_device({gpus!r}): expected a non-empty list of GPU indices.")
    return gpus[0]


def _parse_gpu_ids(gpus: Any, include_cuda: bool = False, include_mps: bool = False) -> list[int] | None:
    """The GPU indices selected by ``gpus`` (an int count, -1, a list, or a string like ``"0,1"``); None for none.

    At least one of ``include_cuda`` and ``include_mps`` says which GPUs count as available.
    """
    if not (include_cuda or include_mps):
        raise FabricValueError(
            "_parse_gpu_ids(include_cuda=False, include_mps=False): no GPU kind is included, so none can be "
            "available. Pass include_cuda=True and/or include_mps=True."
        )
    if gpus is None or (isinstance(gpus, int) and not isinstance(gpus, bool) and gpus == 0):
        return None
    if isinstance(gpus, str) and gpus.strip() in ("0", "[]", ""):
        return None
    if isinstance(gpus, (list, tuple)) and not gpus:
        return None
    return parse_device_indices(gpus, _available_gpus(include_cuda, include_mps), "GPU")


def _available_gpus(include_cuda: bool, include_mps: bool) -> int:
    count = torch.cuda.device_count() if include_cuda else 0
    if include_mps and torch.backends.mps.is_available():
        count += 1
    return count

"""Move optimizer state between devices (Lightning's ``utilities.optimizer`` helpers, which libraries import)."""

from __future__ import annotations

from collections.abc import Iterable

from torch.optim import Optimizer

from fabric.utilities.apply_func import move_to_device
from fabric.utilities.types import _DEVICE


def _optimizer_to_device(optimizer: Optimizer, device: _DEVICE) -> None:
    """Move the state tensors of ``optimizer`` (momentum, variances, ...) to ``device``, in place.

    The ``step`` counters stay where they are: optimizers keep them on the CPU unless ``capturable`` or
    ``fused``, and moving them would break that.
    """
    for state in optimizer.state.values():
        if not isinstance(state, dict):
            continue
        for key, value in state.items():
            if key != "step":
                state[key] = move_to_device(value, device)


def _optimizers_to_device(optimizers: Iterable[Optimizer], device: _DEVICE) -> None:
    """``_optimizer_to_device`` for each optimizer."""
    for optimizer in optimizers:
        _optimizer_to_device(optimizer, device)

"""Collectives over nested collections of tensors and numbers, on top of a strategy's tensor collectives."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fabric.strategies.strategy import Strategy
from fabric.utilities.apply_func import apply_to_collection, convert_to_tensors


def all_gather(
    strategy: Strategy,
    data: Any,
    group: Any | None,
    sync_grads: bool,
    uneven: bool = False,
    device: torch.device | None = None,
) -> Any:
    """Numbers become tensors on the device; each tensor is gathered to shape (world_size, *shape).

    `uneven`: a tensor whose shape differs between processes becomes a list of world_size tensors instead, each
    the one that process sent (a shape exchange first). One process (world_size 1) skips it: nothing can differ.
    `device`: the strategy's root device, when the caller knows it already.
    """
    device = device or strategy.root_device
    if isinstance(data, Tensor) and not uneven:  # the common call: no collection to walk
        if data.device != device or not data.is_contiguous():
            data = _on_device(data, device)
        return strategy.all_gather(data, group=group, sync_grads=sync_grads)
    data = convert_to_tensors(data, device=device)
    if uneven and strategy.world_size > 1:
        from fabric import _uneven_gather

        return _uneven_gather.all_gather(strategy, data, group, sync_grads)
    return apply_to_collection(data, Tensor, strategy.all_gather, group=group, sync_grads=sync_grads)


def all_reduce(
    strategy: Strategy, data: Any, group: Any | None, reduce_op: str, device: torch.device | None = None
) -> Any:
    """Numbers become tensors on the device; each tensor is reduced with `reduce_op`."""
    device = device or strategy.root_device
    if isinstance(data, Tensor):  # the common call: no collection to walk
        if data.device != device or not data.is_contiguous():
            data = _on_device(data, device)
        return strategy.all_reduce(data, group=group, reduce_op=reduce_op)
    data = convert_to_tensors(data, device=device)
    return apply_to_collection(data, Tensor, strategy.all_reduce, group=group, reduce_op=reduce_op)


def _on_device(tensor: Tensor, device: torch.device) -> Tensor:
    """`tensor` on `device`, contiguous (what `convert_to_tensors` does, without walking)."""
    if tensor.device != device:
        tensor = tensor.to(device)
    return tensor if tensor.is_contiguous() else tensor.contiguous()

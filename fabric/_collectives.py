"""Collectives over nested collections of tensors and numbers, on top of a strategy's tensor collectives."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from fabric import _uneven_gather
from fabric.strategies.strategy import Strategy
from fabric.utilities.apply_func import apply_to_collection, convert_to_tensors


def all_gather(strategy: Strategy, data: Any, group: Any | None, sync_grads: bool) -> Any:
    """Numbers become tensors on the device; each tensor is gathered to shape (world_size, *shape).

    A tensor whose shape differs between processes becomes a list of world_size tensors instead, each the one
    that process sent. One process (world_size 1) skips the shape exchange: nothing can differ.
    """
    data = convert_to_tensors(data, device=strategy.root_device)
    if strategy.world_size == 1:
        return apply_to_collection(data, Tensor, strategy.all_gather, group=group, sync_grads=sync_grads)
    return _uneven_gather.all_gather(strategy, data, group, sync_grads)


def all_reduce(strategy: Strategy, data: Any, group: Any | None, reduce_op: str) -> Any:
    """Numbers become tensors on the device; each tensor is reduced with `reduce_op`."""
    data = convert_to_tensors(data, device=strategy.root_device)
    return apply_to_collection(data, Tensor, strategy.all_reduce, group=group, reduce_op=reduce_op)

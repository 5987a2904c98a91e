"""The default gloo group's own collective methods, called with options built once.

`torch.distributed.all_reduce`, `barrier` and `all_gather_single` run 3-6 us of Python before they call the
process group's own method: argument checks (which fabric has made), a new options object, a coalescing-manager
lookup, a wait counter and an exception logger. On local gloo ranks a collective of a few kilobytes takes
100-300 us, and Python before it is felt several times over: it also delays the other ranks, which then wait
asleep. So for the calls a training loop makes (the default group of a gloo-only job, plain real tensors) fabric
calls the group's methods directly: the same backend call with the same options, so the same result.

Everything else goes through `torch.distributed`'s functions: NCCL and mixed backends, subgroups, tensor
subclasses (DTensor and others dispatch through `__torch_function__`), complex tensors (torch views them as real
first), tensors that require grad (autograd's view rules apply differently to the direct call), and a torch whose
process group lacks these methods.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


class DirectGroup:
    """The default group's barrier, all_reduce and flat all_gather, each a method call and a wait."""

    __slots__ = ("_barrier_options", "_gather", "_gather_options", "_group", "_reduce_options", "size")
    # Weak: the group must die with destroy_process_group (gloo's threads and the store's connections with it),
    # even while this object is cached.

    def __init__(self, group: Any) -> None:
        from torch._C._distributed_c10d import AllgatherOptions

        self._group: Callable[[], Any] = weakref.ref(group)  # alive while the strategy issues collectives on it
        self.size: int = group.size()
        self._barrier_options = _options(dist.BarrierOptions)
        self._barrier_options.device = torch.device("cpu")  # what dist.barrier picks for a gloo group
        self._gather_options = _options(AllgatherOptions)
        # torch 2.13 made the flat gather public under this name; older versions have the private one.
        self._gather = "all_gather_single" if hasattr(group, "all_gather_single") else "_allgather_base"
        getattr(group, self._gather)  # no such method: this torch is left to its functions
        self._reduce_options: dict[Any, Any] = {}

    def barrier(self) -> None:
        """`dist.barrier()`."""
        self._group().barrier(self._barrier_options).wait()

    def all_reduce(self, tensor: Tensor, op: Any) -> None:
        """`dist.all_reduce(tensor, op)` for a plain real tensor."""
        options = self._reduce_options.get(op)
        if options is None:
            options = self._reduce_options[op] = _options(dist.AllreduceOptions)
            options.reduceOp = op
        self._group().allreduce([tensor], options).wait()

    def gather_into(self, out: Tensor, flat: Tensor) -> None:
        """`dist.all_gather_single(out, flat)` for plain real tensors."""
        getattr(self._group(), self._gather)(out, flat, self._gather_options).wait()


def _options(kind: Any) -> Any:
    options = kind()
    if hasattr(options, "asyncOp"):  # torch >= 2.8: what the functions set for a blocking call
        options.asyncOp = False
    return options


# (weak reference to the default group, its DirectGroup or None): weak, so the group dies with
# destroy_process_group; a new default group gets its own entry.
_CACHE: list[Any] = [lambda: None, None]


def direct_group() -> DirectGroup | None:
    """The default group's direct calls; None where `torch.distributed`'s functions must be used (or no group)."""
    world = dist.group.WORLD
    if world is None:
        return None
    ref, direct = _CACHE
    if ref() is world:
        return direct
    direct = _make(world)
    _CACHE[:] = [weakref.ref(world), direct]
    return direct


def _make(world: Any) -> DirectGroup | None:
    try:
        if dist.get_backend(world) != "gloo":  # NCCL, or a mixed "cpu:gloo,cuda:nccl" group
            return None
        return DirectGroup(world)
    except Exception:  # a torch without these methods or options: the functions work everywhere
        return None


def direct_for(tensor: Tensor, group: Any | None) -> DirectGroup | None:
    """The default group's direct calls for a collective on `tensor`; None where `torch.distributed`'s functions
    must be used: a subgroup, or a tensor they would not pass to the backend as it is (outside autograd)."""
    if group is not None or type(tensor) is not Tensor or tensor.requires_grad or tensor.is_complex():
        return None
    return direct_group()

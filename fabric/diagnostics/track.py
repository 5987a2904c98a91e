"""The context manager each fabric collective runs in: record it, check it (debug mode), explain its failure."""

from __future__ import annotations

import atexit
import os
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from fabric.diagnostics.check import CollectiveMismatchError, check_same_collective
from fabric.diagnostics.explain import explain, failure_kind
from fabric.diagnostics.record import CollectiveRecorder
from fabric.utilities.exceptions import FabricValueError

DEBUG_VARIABLE = "FABRIC_DEBUG_COLLECTIVES"
_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")

# Set on an error this module wrote, so that an enclosing collective (fabric.save around its barriers) keeps it.
_EXPLAINED = "_fabric_collective_explained"
# One recorder per process group, not per Fabric: two Fabric objects on one group must count its collectives
# together, or the sequence numbers of the ranks would not match. Weak keys: a destroyed group takes its recorder.
_RECORDERS: weakref.WeakKeyDictionary[Any, CollectiveRecorder] = weakref.WeakKeyDictionary()


def debug_enabled() -> bool:
    """Whether FABRIC_DEBUG_COLLECTIVES asks for the cross-rank check."""
    value = os.environ.get(DEBUG_VARIABLE, "").strip().lower()
    if value not in _ON + _OFF:
        raise FabricValueError(
            f"{DEBUG_VARIABLE}={os.environ[DEBUG_VARIABLE]!r}: not a switch. Set it to 1 to compare every collective "
            "across ranks before it runs, or to 0 (or leave it unset) for no check."
        )
    return value in _ON


def start_recording() -> CollectiveRecorder | None:
    """Start recording the default group's collectives (once per group); None where the group has no store."""
    group = dist.group.WORLD
    recorder = _RECORDERS.get(group)
    if recorder is not None:
        return recorder
    debug = debug_enabled()
    store = _default_store()
    try:
        recorder = CollectiveRecorder(store, dist.get_rank(), dist.get_world_size(), group, debug)
    except Exception:  # no store, or one that refuses writes: train on, with only the plain timeout message
        if debug:
            warnings.warn(
                f"{DEBUG_VARIABLE}=1: the process group has no rendezvous store fabric can write to, so collectives "
                "are not compared across ranks, and timeouts do not name the missing rank.",
                stacklevel=2,
            )
        return None
    _RECORDERS[group] = recorder
    # Registered after the group's own exit hook, so it runs first: peers see "exited" before the connection drops.
    atexit.register(recorder.finish)
    return recorder


def stop_recording() -> None:
    """Publish that this rank is done with the default group (before it is destroyed)."""
    world = dist.group.WORLD
    recorder = _RECORDERS.pop(world, None) if world is not None else None
    if recorder is not None:
        recorder.finish()


def _default_store() -> Any:
    # torch has no public accessor for the default group's store; without it there is no diagnosis, only the
    # plain timeout message.
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except Exception:
        return None


@contextmanager
def collective(op: str, waited: str, setting: str, args: tuple[Any, ...] = (), group: Any = None) -> Iterator[None]:
    """Run one collective of the default group (or `group`) with recording, checking and explained failures.

    `waited`/`setting`: the timeout and the call that sets it, for the message. `args`: what must match across
    ranks in debug mode (tensors by dtype and shape, other values by their text).
    """
    world = dist.group.WORLD
    recorder = _RECORDERS.get(world) if world is not None and (group is None or group is world) else None
    if recorder is None or recorder.finished:
        if group is not None and os.environ.get(DEBUG_VARIABLE) and debug_enabled():
            warnings.warn(
                f"{DEBUG_VARIABLE}: fabric.{op}(group=...) runs on a subgroup; only collectives of the default "
                "group are compared across ranks and named in timeout messages.",
                stacklevel=3,
            )
        with _explain_plain(op, waited, setting):
            yield
        return
    entered = recorder.enter(op)
    try:
        if recorder.debug:
            check_same_collective(recorder, entered, args)
        yield
    except CollectiveMismatchError:
        raise
    except RuntimeError as err:
        kind = failure_kind(err)
        if kind is None or getattr(err, _EXPLAINED, False):  # a nested collective (a barrier in a save) explained it
            raise
        explained = RuntimeError(explain(recorder, entered, kind, waited, setting))
        setattr(explained, _EXPLAINED, True)
        raise explained from err
    recorder.leave(entered)


@contextmanager
def _explain_plain(op: str, waited: str, setting: str) -> Iterator[None]:
    from fabric.utilities.distributed import explain_timeout

    with explain_timeout(op, waited, setting):
        yield

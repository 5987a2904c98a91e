"""Attach job health to the default process group, and the one place that orders a rank's exit.

One JobHealth per process group (two Fabric objects on one group share it, and its one thread). At exit, in this
order: publish how this rank ended, stop the health thread (a daemon thread inside a store call while the
interpreter shuts down can abort the process), then destroy the process group fabric created (gloo processes
that exit with a live group can abort).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import weakref
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from fabric.health.job import JobHealth

_HEALTH: weakref.WeakKeyDictionary[Any, JobHealth] = weakref.WeakKeyDictionary()
_EXIT_ORDERED: weakref.WeakSet[Any] = weakref.WeakSet()  # groups whose exit is ordered already


def attach_health(
    store: Any, rank: int, world_size: int, timeout: timedelta, exit_on_abort: bool, owns_group: bool
) -> JobHealth | None:
    """The default group's JobHealth, started on first use; None for one process or a group without a store."""
    group = dist.group.WORLD
    health = _HEALTH.get(group)
    if group not in _EXIT_ORDERED:
        # Registered before anything else of this group, so that it runs last, after the group's own hooks.
        _EXIT_ORDERED.add(group)
        atexit.register(_at_exit, weakref.ref(group), owns_group)
    if health is None:
        if store is None or world_size < 2:
            return None
        health = JobHealth(store, rank, world_size, timeout, group, exit_on_abort)
        _HEALTH[group] = health
        _chain_excepthook(weakref.ref(health))
        health.start()
    health.exit_on_abort = health.exit_on_abort or exit_on_abort
    return health


def release_health() -> None:
    """Stop the default group's health thread, before the group is destroyed (teardown)."""
    health = _HEALTH.pop(dist.group.WORLD, None) if dist.is_initialized() else None
    if health is not None:
        health.stop()


def _at_exit(group: weakref.ref, destroy: bool) -> None:
    world = group()
    health = _HEALTH.pop(world, None) if world is not None else None
    if health is not None and health.pid == os.getpid():
        recorder = health._recorder
        if recorder is not None:
            recorder.finish()  # the peers see "exited" or "failed" before the connections drop
        with contextlib.suppress(Exception):
            health.stop()
    if destroy and world is not None and dist.is_initialized() and dist.group.WORLD is world:
        # A weak reference: the group must not outlive destroy_process_group until interpreter finalisation,
        # where freeing gloo's threads aborts the process ("terminate called without an active exception").
        dist.destroy_process_group()


def _chain_excepthook(ref: weakref.ref) -> None:
    """An uncaught exception in this rank leaves the abort mark before the traceback is printed."""
    previous = sys.excepthook

    def hook(*exc_info: Any) -> None:
        health = ref()
        if health is not None:
            health.report_failure()
        previous(*exc_info)

    sys.excepthook = hook

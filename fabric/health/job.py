"""The one job-health thread of a rank, on a store connection of its own.

Each tick costs two requests, whatever the job's size: read one counter that any rank raises when it leaves news
(a preemption request adds 1, an abort mark ABORT_STEP), and publish this rank's record (its heartbeat value
goes up). A tick that has news to write instead of the record writes at most two keys, so no tick costs more than
three requests. Ticks are spaced so the whole job stays within JOB_REQUESTS_PER_SECOND on the one store, and each
rank's first tick is offset by its rank, so the ranks do not tick together.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from fabric.diagnostics.record import own_connection

if TYPE_CHECKING:
    from fabric.diagnostics.record import CollectiveRecorder
    from fabric.health.preemption import Preemption

NEWS_KEY = "fabric/health/news"  # +1 for each preemption request, +ABORT_STEP for each failed rank
ABORT_STEP = 1 << 32
ABORT_KEY = "fabric/abort"  # the global rank that failed with an exception
THREAD_NAME = "fabric-health"
REQUESTS_PER_TICK = 2  # the news counter, and the record with its heartbeat (or the news this rank writes)
JOB_REQUESTS_PER_SECOND = 450  # for the whole job, whose one store is a single server; the bound is 500
MIN_TICK_SECONDS = 0.2


def tick_seconds(world_size: int) -> float:
    """How often each rank ticks, so that all of them together stay within JOB_REQUESTS_PER_SECOND."""
    return max(MIN_TICK_SECONDS, REQUESTS_PER_TICK * world_size / JOB_REQUESTS_PER_SECOND)


def first_delay(rank: int, world_size: int) -> float:
    """The offset of the rank's first tick: the ranks start together, and must not tick together."""
    return tick_seconds(world_size) * (rank % world_size) / world_size


class JobHealth:
    """Heartbeat, preemption news and abort marks of one rank in a job of `world_size` ranks."""

    def __init__(
        self, store: Any, rank: int, world_size: int, timeout: timedelta, group: Any = None, exit_on_abort: bool = False
    ) -> None:
        self.store = store  # the training thread's connection: only for its own failure and the preemption agreement
        self._conn: Any = own_connection(store)  # the health thread's
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.tick_seconds = tick_seconds(world_size)
        self.first_delay = first_delay(rank, world_size)
        # Nothing else ends this process when another rank fails (no launcher, no agent): end it on the abort mark.
        self.exit_on_abort = exit_on_abort
        self._group = weakref.ref(group) if group is not None else None
        self._recorder: CollectiveRecorder | None = None
        self._preemptions: weakref.WeakSet[Preemption] = weakref.WeakSet()
        # Read by signal handlers, which must not call the store: set here, by the thread.
        self.abort_seen = False
        self.request_seen = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.pid = os.getpid()

    # -- what the rank hands over ------------------------------------------------------------------------
    def adopt(self, recorder: CollectiveRecorder) -> None:
        """Publish `recorder`'s record at each tick; its timeout messages watch heartbeats at this pace."""
        recorder.heartbeat_seconds = self.tick_seconds
        recorder.stale_seconds = max(self.timeout.total_seconds(), 3 * self.tick_seconds)
        self._recorder = recorder

    def add(self, preemption: Preemption) -> None:
        """Share `preemption`'s signal and learn of the other ranks' through the store."""
        self._preemptions.add(preemption)

    def remove(self, preemption: Preemption) -> None:
        """Undo add."""
        self._preemptions.discard(preemption)

    def wake(self) -> None:
        """Tick now (a signal arrived); safe in a signal handler."""
        self._wake.set()

    def report_failure(self) -> None:
        """This rank is failing (training thread): leave the abort mark before the process leaves the group."""
        self.exit_on_abort = False  # its own mark must not end it before it has printed its error
        store = self.store
        if store is None:
            return
        try:
            store.set(ABORT_KEY, str(self.rank))
            store.add(NEWS_KEY, ABORT_STEP)
        except Exception:  # the store's host is gone: the others learn of the failure from their collectives
            return

    # -- the thread ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread and let its connection go (before the process group and its store go away)."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and os.getpid() == self.pid:
            # Bounded: a request to a store whose host has gone fails at once, but an exit must never hang here.
            thread.join(timeout=self.tick_seconds + 5)
        self._conn = None

    def tick(self) -> None:
        """One tick's requests, through the thread's connection."""
        conn = self._conn
        preemptions = list(self._preemptions)
        # The signals caught before the news is read: a launcher that ends the job after a failure signals after
        # the failed rank left its abort mark, so this read sees the mark of any failure behind them. A signal
        # caught after the read waits for the next tick (its handler wakes this thread for it at once).
        caught = [preemption.caught() for preemption in preemptions]
        news = int(conn.add(NEWS_KEY, 0))
        if news >= ABORT_STEP and not self.abort_seen:
            self.abort_seen = True
            if self.exit_on_abort:
                _end_for(conn.get(ABORT_KEY).decode(), self.rank)
        self.request_seen = self.request_seen or news % ABORT_STEP > 0
        wrote = False
        for preemption, signalled in zip(preemptions, caught, strict=True):
            wrote = preemption.on_tick(self, conn, signalled) or wrote
        if self._recorder is not None and not wrote:  # the heartbeat waits a tick rather than a third request
            self._recorder.publish(conn)

    def _run(self) -> None:
        next_due = time.monotonic() + self.first_delay
        while not self._stop.is_set():
            self._wake.wait(max(0.0, next_due - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                return
            if not self._group_alive():
                # Destroyed without fabric's teardown: nobody reads the records any more. Let the connections go
                # now (on rank 0 the store is a listening server), not at interpreter finalisation.
                self._stop.set()
                self._conn = self.store = None
                return
            try:
                self.tick()
            except Exception:  # the store is gone with its host: the job is broken, and a late signal ends it
                self.abort_seen = True
                return
            now = time.monotonic()
            if now >= next_due:
                next_due = max(next_due + self.tick_seconds, now)

    def _group_alive(self) -> bool:
        if self._group is None:
            return True
        import torch.distributed as dist

        group = self._group()
        return group is not None and dist.is_initialized() and dist.group.WORLD is group


def _end_for(failed: str, rank: int) -> None:
    print(
        f"[fabric] Global rank {failed} failed (its error is in its output), so global rank {rank} ends too "
        "instead of waiting for it.",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)

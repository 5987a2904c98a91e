"""`fabric.preempted`: a preemption signal to any rank becomes one decision that every rank takes at the same check.

Each rank counts its checks. A rank that learns of the preemption (its own signal, or the request another rank
left in the store, which the job-health thread reads) publishes how many checks it has answered with False so far.
Every rank then answers False until the largest published count and True at the check after it, so all ranks stop
at the same step and can save a checkpoint together. A job that is never preempted pays a lock and an increment
per check.

The signal handler only sets a flag and wakes the health thread, which announces it. Where a launcher or an agent
ends the ranks after one failed (fabric's launchers, torchrun), the signal it sends is not a preemption: a rank
that knows of the failure dies of the signal, as without fabric.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
from typing import TYPE_CHECKING, Any

from fabric.health.job import NEWS_KEY
from fabric.utilities import _signals

if TYPE_CHECKING:
    from fabric.health.job import JobHealth

COUNT_KEY = "fabric/preempt/checks/{rank}"


class Preemption:
    """The preemption state of one Fabric in one process."""

    def __init__(self) -> None:
        self._signalled = threading.Event()
        self._signum = 0
        self._lock = threading.Lock()
        self._checks = 0  # checks answered so far
        self._known = False  # this rank knows the job is preempted
        self._announced = False
        self._stop_after: int | None = None  # the agreed number of checks answered False
        self._decided = False
        self._armed: tuple[int, ...] = ()
        self._health: JobHealth | None = None

    # -- setup ------------------------------------------------------------------------------------
    def arm(self) -> bool:
        """Catch the preemption signals from now on (main thread only); False if they cannot be caught here."""
        if self._armed:
            return True
        signals = _signals.preemption_signals()
        if not all(_signals.add_catcher(signum, self._catch) for signum in signals):
            return False
        self._armed = signals
        return True

    def attach(self, health: JobHealth | None) -> None:
        """Share decisions with the other ranks through the rank's job-health thread (None: one process)."""
        if health is None or self._health is not None:
            return
        self._health = health
        health.add(self)

    def detach(self) -> None:
        """Stop sharing, before the process group and its store go away.

        The signals stay caught until the process ends: a rank that saved and is exiting must not die of a
        preemption signal that reaches it late (its exit code would then report a failure).
        """
        if self._health is not None:
            self._health.remove(self)
        self._health = None

    # -- the training thread --------------------------------------------------------------------------
    def check(self) -> bool:
        """Whether the job is preempted; every rank gets True at the same (n-th) check."""
        if self._decided:
            return True
        health = self._health
        if health is None:  # one process: its own signal decides
            self._decide(self._signalled.is_set())
            return self._decided
        with self._lock:
            if not self._known:
                self._checks += 1
                return False
        stop_after = self._agreed_stop(health)
        with self._lock:
            self._checks += 1
            decided = self._checks > stop_after
        self._decide(decided)
        return decided

    def report_failure(self) -> None:
        """This rank is failing: leave the abort mark for the others (before this process leaves the group)."""
        if self._health is not None:
            self._health.report_failure()

    def _decide(self, decided: bool) -> None:
        if decided and not self._decided:
            # Python resets caught signals to their default while it shuts down; a preemption signal that reaches
            # this rank late (it saved after learning from another rank) would then make a clean exit look failed.
            atexit.register(_ignore, self._armed)
        self._decided = decided

    def _agreed_stop(self, health: JobHealth) -> int:
        """The largest count of False answers any rank gave before it learned of the preemption."""
        if self._stop_after is not None:
            return self._stop_after
        store, timeout = health.store, health.timeout
        keys = [COUNT_KEY.format(rank=rank) for rank in range(health.world_size)]
        try:  # two requests per rank, whatever the job's size: the store answers the wait when all keys are there
            store.wait(keys, timeout)
        except Exception as err:
            missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
            if not missing:
                raise
            raise RuntimeError(
                f"fabric.preempted: the job was preempted, but rank(s) {missing} did not answer within "
                f"{timeout}, so the ranks cannot agree on the step to stop at. A rank has probably died; "
                "check its output. The job cannot save a checkpoint together; restart from the last one."
            ) from err
        self._stop_after = max(int(value) for value in store.multi_get(keys))
        return self._stop_after

    # -- the signal handler: no store, no lock -------------------------------------------------------
    def _catch(self, signum: int) -> None:
        health = self._health
        if health is not None and health.abort_seen:
            _die_of(signum)  # a launcher ending the job after a failure, not a preemption
        self._signum = signum
        self._signalled.set()
        if health is not None:
            health.wake()

    # -- the health thread ----------------------------------------------------------------------------
    def caught(self) -> bool:
        """Whether a preemption signal reached this rank (the health thread asks before it reads the news)."""
        return self._signalled.is_set()

    def on_tick(self, health: JobHealth, conn: Any, caught: bool) -> bool:
        """Announce this rank's signal, or learn of another rank's, through the thread's connection `conn`.

        `caught`: the signal had arrived before this tick read the news, so `health.abort_seen` already tells
        whether it came with a failure. True if it wrote to the store (at most two requests, once).
        """
        wrote = False
        if caught and not self._announced:
            self._announced = True
            if health.abort_seen:
                # The signal came with the job's failure: let the main thread's handler die of it.
                signal.pthread_kill(threading.main_thread().ident or 0, self._signum)
                return False
            conn.add(NEWS_KEY, 1)
            health.request_seen = wrote = True
        if not self._known and health.request_seen:
            with self._lock:
                self._known = True
                answered = self._checks
            conn.set(COUNT_KEY.format(rank=health.rank), str(answered))
            wrote = True
        return wrote


def _die_of(signum: int) -> None:
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _ignore(signals: tuple[int, ...]) -> None:
    for signum in signals:
        signal.signal(signum, signal.SIG_IGN)

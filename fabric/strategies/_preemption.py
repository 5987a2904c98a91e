"""How a job ends: `fabric.preempted` agreed by all ranks, and no rank left behind when another one failed.

`fabric.preempted`: a preemption signal to any rank becomes one decision that every rank takes at the same check.

Each rank counts its checks. A rank that learns of the preemption (its own signal, or the request another rank
left in the rendezvous store, which a background thread polls) publishes how many checks it has answered with
False so far. Every rank then answers False until the largest published count and True at the check after it, so
all ranks stop at the same step and can save a checkpoint together. A job that is never preempted pays a lock and
an increment per check; the store is only polled by the background thread.

A rank that fails with an exception leaves an abort mark in the store first. Where no launcher or agent ends the
other ranks (srun, mpirun, ...), the background thread of each of them ends its process when it sees the mark,
even while the main thread is stuck in the user's own code. A rank killed outright (SIGKILL, the OOM killer) leaves
no mark: there each rank also watches the next one's hang-diagnosis record (fabric/diagnostics), and leaves the mark
for it when that process is gone (same host) or silent for longer than the collective timeout. Where a launcher or
an agent ends the other ranks (fabric's launchers, torchrun), the signal it sends is not taken for a preemption
once the mark is there.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
import weakref
from datetime import timedelta
from typing import Any

from fabric.utilities import _signals
from fabric.utilities import distributed as _dist

_POLL_SECONDS = 0.2
# Every rank polls the one rendezvous store: keep the whole job under about this many requests per second.
_STORE_REQUESTS_PER_SECOND = 500
_REQUEST_KEY = "fabric/preempt/request"
_COUNT_KEY = "fabric/preempt/checks/{rank}"
_ABORT_KEY = "fabric/abort"
_KILLED = "killed"
_NEIGHBOUR_SECONDS = 1.0  # how often each rank reads its neighbour's record, where it must end itself


class Preemption:
    """The preemption state of one process in a job of `world_size` processes."""

    def __init__(self) -> None:
        self._signalled = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._checks = 0  # checks answered so far
        self._known = False  # this rank knows the job is preempted
        self._stop_after: int | None = None  # the agreed number of checks answered False
        self._decided = False
        self._armed: tuple[int, ...] = ()
        self._store: Any = None
        self._rank, self._world_size, self._timeout = 0, 1, timedelta(minutes=30)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._exit_on_abort = False
        self._records: Any = None
        self._poll_seconds = _POLL_SECONDS

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

    def attach(self, store: Any, rank: int, world_size: int, timeout: timedelta, exit_on_abort: bool) -> None:
        """Share decisions through `store` (the job's rendezvous store) with the other ranks.

        `exit_on_abort`: nothing else ends this process when another rank fails, so end it here.
        """
        if store is None or world_size < 2 or self._thread is not None:
            return
        self._store, self._rank, self._world_size, self._timeout = store, rank, world_size, timeout
        self._exit_on_abort = exit_on_abort
        # The hang-diagnosis records live in the default group's store, which torch prefixes; None: not readable.
        self._records = _dist.default_store() if exit_on_abort else None
        self._poll_seconds = max(_POLL_SECONDS, world_size / _STORE_REQUESTS_PER_SECOND)
        _chain_excepthook(weakref.ref(self))
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="fabric-preemption", daemon=True)
        self._thread.start()
        # A daemon thread inside a store call at interpreter shutdown can abort the process: stop it first.
        atexit.register(_detach_at_exit, weakref.ref(self))

    def detach(self) -> None:
        """Stop sharing, before the process group and its store go away.

        The signals stay caught until the process ends: a rank that saved and is exiting must not die of a
        preemption signal that reaches it late (its exit code would then report a failure).
        """
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
        self._store = None

    # -- the decision ----------------------------------------------------------------------------
    def check(self) -> bool:
        """Whether the job is preempted; every rank gets True at the same (n-th) check."""
        if self._decided:
            return True
        if self._store is None:  # one process: its own signal decides
            self._decided = self._signalled.is_set()
            return self._decided
        with self._lock:
            if not self._known:
                self._checks += 1
                return False
        stop_after = self._agreed_stop()
        with self._lock:
            self._checks += 1
            self._decided = self._checks > stop_after
        return self._decided

    def report_failure(self) -> None:
        """This rank is failing: leave the abort mark for the others (before this process leaves the group)."""
        self._exit_on_abort = False  # its own mark must not end it before it has printed its error
        store = self._store
        if store is not None:
            with contextlib.suppress(Exception):
                store.set(_ABORT_KEY, str(self._rank))

    def _catch(self, signum: int) -> None:
        if self._job_failing():
            # A launcher ending the job after a failure, not a preemption: die of it as without fabric.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._signalled.set()
        self._wake.set()

    def _job_failing(self) -> bool:
        store = self._store
        if store is None:
            return False
        try:
            return bool(store.check([_ABORT_KEY]))
        except Exception:  # the store is gone with the rank that hosted it: the job is broken
            return True

    def _agreed_stop(self) -> int:
        """The largest count of False answers any rank gave before it learned of the preemption."""
        if self._stop_after is not None:
            return self._stop_after
        keys = [_COUNT_KEY.format(rank=rank) for rank in range(self._world_size)]
        deadline = time.monotonic() + self._timeout.total_seconds()
        while not self._store.check(keys):
            if time.monotonic() > deadline:
                missing = [rank for rank, key in enumerate(keys) if not self._store.check([key])]
                raise RuntimeError(
                    f"fabric.preempted: the job was preempted, but rank(s) {missing} did not answer within "
                    f"{self._timeout}, so the ranks cannot agree on the step to stop at. A rank has probably died; "
                    "check its output. The job cannot save a checkpoint together; restart from the last one."
                )
            time.sleep(self._poll_seconds / 4)
        self._stop_after = max(int(self._store.get(key)) for key in keys)
        return self._stop_after

    def _watch(self) -> None:
        """Background: announce this rank's signal, and learn of any rank's, through the store."""
        announced = False
        next_look = time.monotonic()
        try:
            while not self._stop.is_set():
                if self._exit_on_abort and time.monotonic() >= next_look:
                    next_look = time.monotonic() + _NEIGHBOUR_SECONDS
                    self._mark_if_neighbour_died()
                if self._exit_on_abort and self._store.check([_ABORT_KEY]):
                    self._abort()
                if self._signalled.is_set() and not announced:
                    self._store.set(_REQUEST_KEY, str(self._rank))
                    announced = True
                if not self._known and (announced or self._store.check([_REQUEST_KEY])):
                    with self._lock:
                        self._known = True
                        answered = self._checks
                    self._store.set(_COUNT_KEY.format(rank=self._rank), str(answered))
                self._wake.wait(self._poll_seconds)
                self._wake.clear()
        except Exception:  # the store went away (a rank exited): nothing left to share through
            return

    def _mark_if_neighbour_died(self) -> None:
        """Leave the abort mark for the next rank if it ended without one (one store read per rank and second)."""
        from fabric.diagnostics.explain import liveness
        from fabric.diagnostics.record import PeerRecord, record_key

        neighbour = (self._rank + 1) % self._world_size
        key = record_key(neighbour)
        if self._records is None or not self._records.check([key]):
            return
        record = PeerRecord.decode(neighbour, self._records.get(key))
        # Slower than the collective timeout: a rank that is merely busy would have failed its peers by then anyway.
        why = liveness(record, stale_seconds=max(self._timeout.total_seconds(), 5.0))
        if why is not None and record.state != "exited":  # a clean exit is no failure; its peers time out instead
            self._store.compare_set(_ABORT_KEY, "", f"{neighbour} {_KILLED}")

    def _abort(self) -> None:
        failed, _, how = self._store.get(_ABORT_KEY).decode().partition(" ")
        what = (
            "was killed or crashed (it recorded no exit)" if how == _KILLED else "failed (its error is in its output)"
        )
        print(
            f"[fabric] Global rank {failed} {what}, so global rank {self._rank} ends too instead of waiting for it.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)


def _chain_excepthook(ref: weakref.ref) -> None:
    """An uncaught exception in this rank leaves the abort mark before the traceback is printed."""
    previous = sys.excepthook

    def hook(*exc_info: Any) -> None:
        preemption = ref()
        if preemption is not None:
            preemption.report_failure()
        previous(*exc_info)

    sys.excepthook = hook


def _detach_at_exit(ref: weakref.ref) -> None:
    preemption = ref()
    if preemption is None:
        return
    with contextlib.suppress(Exception):
        preemption.detach()
    if preemption._decided:
        # Python resets caught signals to their default while it shuts down; a preemption signal that reaches
        # this rank late (it saved after learning from another rank) would then make a clean exit look failed.
        for signum in preemption._armed:
            signal.signal(signum, signal.SIG_IGN)

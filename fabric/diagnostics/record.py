"""Each rank's record of its last fabric collective, published with a heartbeat to the rendezvous store.

The calling thread only counts and assigns a few fields (no string, no object built per call); a background
thread per rank pushes the latest record to the store when it changed (at most every 0.1 s) and at least every
second as a heartbeat, so a timed-out rank can read where every other rank is without any collective.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from types import CodeType
from typing import Any

from fabric.diagnostics.callsite import site_text

# How often the publisher looks for a new record, and the longest gap between two publications (the heartbeat).
# Large jobs look less often (up to once a second), so the store, one server for the whole job, is not flooded.
_POLL_SECONDS = 0.1
HEARTBEAT_SECONDS = 1.0
_KEY_PREFIX = "fabric/diag/rank/"


def record_key(rank: int) -> str:
    """The store key under which `rank` publishes its record."""
    return f"{_KEY_PREFIX}{rank}"


class Collective:
    """One collective as a rank entered it: its sequence number, operation and the user's call site.

    Made from a published record (`site` given) or from the recorder's fields (`code` and `offset` of the user's
    frame), whose `file.py:LINE` is worked out only when something reads `site`.
    """

    __slots__ = ("_code", "_offset", "_site", "op", "seq")

    def __init__(self, seq: int, op: str, site: str | None = None, code: CodeType | None = None, offset: int = -1):
        self.seq, self.op = seq, op
        self._site, self._code, self._offset = site, code, offset

    @property
    def site(self) -> str:
        """`train.py:52`."""
        if self._site is None:
            self._site = site_text(self._code, self._offset)
        return self._site

    def describe(self) -> str:
        """`#7 all_reduce() at train.py:52`."""
        return f"#{self.seq} {self.op}() at {self.site}"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Collective):
            return NotImplemented
        return (self.seq, self.op, self.site) == (other.seq, other.op, other.site)

    def __hash__(self) -> int:
        return hash((self.seq, self.op, self.site))

    def __repr__(self) -> str:
        return f"Collective({self.seq}, {self.op!r}, {self.site!r})"


@dataclass(frozen=True)
class PeerRecord:
    """What a rank last published about itself."""

    rank: int
    last: Collective | None
    inside: bool  # still inside `last` (entered, not yet returned)
    state: str  # "running", "exited" (its script ended) or "failed" (ended by an uncaught exception)
    error: str  # the exception that ended it, for state "failed"
    pid: int
    host: str
    heartbeat: float  # time.time() of the publication

    @classmethod
    def decode(cls, rank: int, raw: bytes) -> PeerRecord:
        data = json.loads(raw)
        last = Collective(*data["last"]) if data["last"] else None
        fields = ("inside", "state", "error", "pid", "host", "heartbeat")
        return cls(rank, last, *(data[name] for name in fields))


class CollectiveRecorder:
    """Counts this rank's collectives on one process group and publishes the last one to the group's store."""

    def __init__(self, store: Any, rank: int, world_size: int, group: Any, debug: bool) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        # Whether to compare every collective across ranks before issuing it (FABRIC_DEBUG_COLLECTIVES).
        self.debug = debug
        self._group = weakref.ref(group)  # never keep the group alive: gloo's threads must die with it
        # The last collective entered, as plain fields the calling thread assigns (see enter/snapshot).
        self._seq = self._writing = 0
        self._op, self._offset, self._inside = "", -1, False
        self._code: CodeType | None = None
        self._state, self._error = "running", ""
        self._pid, self._host = os.getpid(), socket.gethostname()
        self._stop = threading.Event()
        self._poll = min(HEARTBEAT_SECONDS, max(_POLL_SECONDS, world_size / 1000))
        self._published: tuple[int, bool] | None = None
        self._published_at = 0.0
        # A connection of its own, so the publisher never waits behind the calling thread's store requests.
        self._publisher_store = _own_connection(store)
        # Debug mode's cross-rank comparison waits on the store for up to the collective timeout: on a connection
        # of its own, so that it never holds the shared client's lock (and stalls its other users) meanwhile.
        self.check_store = _own_connection(store) if debug else None
        self._publish(store)  # at once: peers must find the key even if this rank never issues a collective
        self._thread = threading.Thread(target=self._run, name="fabric-collective-record", daemon=True)
        self._thread.start()

    # -- the calling thread (hot path) -------------------------------------------------------------------
    def enter(self, op: str, code: CodeType | None, offset: int) -> int:
        """Record that this rank enters collective `op`, issued at instruction `offset` of the user's `code`.

        Returns its sequence number, to pass to `leave`. `_writing` goes first and `_seq` last, so that a reader
        on another thread can tell a consistent set of fields from a half-written one (see `snapshot`).
        """
        seq = self._seq + 1
        self._writing = seq
        self._op, self._code, self._offset, self._inside = op, code, offset, True
        self._seq = seq
        return seq

    def leave(self, seq: int) -> None:
        """Record that collective `seq` returned (or failed)."""
        self._inside = False

    def entered(self, seq: int, op: str) -> Collective:
        """Collective `seq` as this rank entered it, for a message. Its site is the last one recorded: a
        collective nested in it (a barrier in a save) was issued from the same line of the user's code."""
        return Collective(seq, op, code=self._code, offset=self._offset)

    def snapshot(self) -> tuple[Collective | None, bool]:
        """The last collective entered and whether this rank is still inside it; safe from any thread."""
        while True:
            seq = self._seq
            op, code, offset, inside = self._op, self._code, self._offset, self._inside
            if self._writing == seq:  # no enter() started since `seq` was read: the fields belong to it
                break
        return (Collective(seq, op, code=code, offset=offset) if seq else None), inside

    def position(self) -> tuple[int, bool]:
        """(sequence number, inside): changes whenever the record does; cheap to compare."""
        return self._seq, self._inside

    # -- publishing ----------------------------------------------------------------------------------------
    def _encode(self) -> str:
        last, inside = self.snapshot()
        fields = [last.seq, last.op, last.site] if last else None
        return json.dumps(
            {
                "last": fields,
                "inside": inside,
                "state": self._state,
                "error": self._error,
                "pid": self._pid,
                "host": self._host,
                "heartbeat": time.time(),
            }
        )

    def _publish(self, store: Any) -> None:
        position = self.position()
        store.set(record_key(self.rank), self._encode())
        self._published, self._published_at = position, time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            group = self._group()
            if group is None or not _is_default_group(group):
                # Destroyed without fabric's teardown: nobody reads these records any more. Let the store go now
                # (on rank 0 it is a listening server), not when the exit hook that holds this recorder runs.
                self._stop.set()
                self.store = self._publisher_store = None
                return
            if self.position() == self._published and time.monotonic() - self._published_at < HEARTBEAT_SECONDS:
                continue
            try:
                self._publish(self._publisher_store)
            except Exception:
                return  # the store is gone (its host, rank 0, exited): nothing left to publish to

    def finish(self) -> None:
        """Publish that this rank ended (with the error that ended it, if any) and stop publishing. Idempotent."""
        if os.getpid() != self._pid:  # a forked child: the thread and the record are its parent's
            return
        if self._stop.is_set():  # finished already, or the publisher stopped on its own (its group was destroyed)
            # It may still be freeing the store there; a daemon thread inside C++ code when the interpreter
            # finalises aborts the process ("terminate called without an active exception").
            self._thread.join(timeout=HEARTBEAT_SECONDS)
            return
        self._stop.set()
        error = getattr(sys, "last_value", None)  # set for an uncaught exception before atexit hooks run
        self._state = "failed" if error is not None else "exited"
        self._error = _short(error) if error is not None else ""
        self._thread.join(timeout=HEARTBEAT_SECONDS)
        with contextlib.suppress(Exception):  # the store's host may be gone already
            self._publish(self.store)
        # Drop the stores now, not at interpreter finalisation, where freeing rank 0's store server can abort.
        self.store = self._publisher_store = self.check_store = None

    @property
    def finished(self) -> bool:
        """Whether `finish` ran."""
        return self._stop.is_set()


def _own_connection(store: Any) -> Any:
    """A second client of `store` (TCPStore), or the store itself where it cannot be cloned (HashStore, ...)."""
    try:
        return store.clone()
    except Exception:
        return store


def _is_default_group(group: Any) -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.group.WORLD is group


def _short(error: BaseException, limit: int = 200) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0] if str(error) else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."

"""Each rank's record of its last fabric collective, for the rendezvous store, so a timed-out rank can say where
every other rank is without any collective.

The calling thread only counts and assigns a few fields (no string, no object built per call); a backward pass
that fabric runs on its fast path only adds 1 to `backwards`. The job-health thread (fabric/health) publishes the
record, with a heartbeat counter that goes up at each publication, and looks at the stacks to tell whether a
counted backward is still running and from which line; `finish` publishes how the rank ended.

Numbering: a backward pass is one collective among the others (DDP's gradient all-reduce), whether it was counted
or entered like the rest (debug mode, strategies that shard); so the numbers are the same in every mode.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import weakref
from dataclasses import dataclass
from types import CodeType
from typing import Any

from fabric.diagnostics.callsite import backward_caller, site_text

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
        """`#7 all_reduce() at train.py:52`; without the site where it is not known (a counted backward that ended
        before the health thread saw it)."""
        site = self.site
        return f"#{self.seq} {self.op}() at {site}" if site else f"#{self.seq} {self.op}()"

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
    pid: int  # for the reader of a message only: a pid means nothing on another host or in another PID namespace
    host: str
    beat: int  # goes up at each publication: a value, never a time, so no two hosts' clocks are compared

    @classmethod
    def decode(cls, rank: int, raw: bytes) -> PeerRecord:
        data = json.loads(raw)
        last = Collective(*data["last"]) if data["last"] else None
        fields = ("inside", "state", "error", "pid", "host", "beat")
        return cls(rank, last, *(data[name] for name in fields))


class CollectiveRecorder:
    """Counts this rank's collectives on one process group; `publish` writes the last one to the group's store."""

    def __init__(self, store: Any, rank: int, world_size: int, group: Any, debug: bool) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        # Whether to compare every collective across ranks before issuing it (FABRIC_DEBUG_COLLECTIVES).
        self.debug = debug
        self._group = weakref.ref(group)  # never keep the group alive: gloo's threads must die with it
        # The last collective entered, as plain fields the calling thread assigns (see enter/snapshot): its number,
        # and `backwards` when it was entered (`_after`).
        self._seq = self._writing = self._after = 0
        self._op, self._offset, self._inside = "", -1, False
        self._code: CodeType | None = None
        # Backward passes counted on fabric's fast path (Fabric.backward adds 1 before each: nothing else per step).
        self.backwards = 0
        # The last counted backward the health thread saw running: (number, user's code, offset), for its site.
        self._seen_backward: tuple[int, CodeType | None, int] = (0, None, -1)
        self._state, self._error = "running", ""
        self._pid, self._host = os.getpid(), socket.gethostname()
        self._beat = 0
        self._finished = False
        self._publishing = threading.Lock()  # the final record must not be overtaken by an older one
        # How often the job-health thread publishes, and how long a silent heartbeat is taken for a dead rank in
        # messages (the collective timeout); set when it attaches.
        self.heartbeat_seconds = 1.0
        self.stale_seconds = float("inf")
        # An exception a notebook cell left behind before this group started is not this rank's failure.
        self._earlier_error = getattr(sys, "last_value", None)
        # Debug mode's cross-rank comparison waits on the store for up to the collective timeout: on a connection
        # of its own, so that it never holds the shared client's lock (and stalls its other users) meanwhile.
        self.check_store = own_connection(store) if debug else None
        self._write(store)  # at once (raises without a usable store): peers find the key even before the first tick

    # -- the calling thread (hot path) -------------------------------------------------------------------
    def enter(self, op: str, code: CodeType | None, offset: int) -> int:
        """Record that this rank enters collective `op`, issued at instruction `offset` of the user's `code`.

        Returns its sequence number, to pass to `leave`. `_writing` goes first and `_seq` last, so that a reader
        on another thread can tell a consistent set of fields from a half-written one (see `snapshot`).
        """
        backwards = self.backwards
        seq = self._seq + backwards - self._after + 1  # the backward passes counted since take a number each
        self._writing = seq
        self._op, self._code, self._offset, self._inside, self._after = op, code, offset, True, backwards
        self._seq = seq
        return seq

    def leave(self, seq: int) -> None:
        """Record that collective `seq` returned (or failed)."""
        self._inside = False

    def entered(self, seq: int, op: str) -> Collective:
        """Collective `seq` as this rank entered it, for a message. Its site is the last one recorded: a
        collective nested in it (a barrier in a save) was issued from the same line of the user's code."""
        return Collective(seq, op, code=self._code, offset=self._offset)

    def backward_entered(self, code: CodeType | None, offset: int) -> Collective:
        """The counted backward pass this rank is in (it has been counted), issued at `offset` of `code`."""
        return Collective(self._seq + self.backwards - self._after, "backward", code=code, offset=offset)

    def snapshot(self) -> tuple[Collective | None, bool]:
        """The last collective entered or backward counted, and whether this rank is still inside it; safe from
        any thread other than the training thread (a counted backward is looked for in the training's stack)."""
        while True:
            seq = self._seq
            op, code, offset, inside, after = self._op, self._code, self._offset, self._inside, self._after
            if self._writing == seq:  # no enter() started since `seq` was read: the fields belong to it
                break
        backwards = self.backwards
        if backwards == after:
            return (Collective(seq, op, code=code, offset=offset) if seq else None), inside
        return self._last_backward(seq + backwards - after)

    def _last_backward(self, number: int) -> tuple[Collective, bool]:
        """Counted backward `number`, the last thing this rank entered: whether it still runs, and from where."""
        frame = backward_caller()
        if frame is not None:
            self._seen_backward = (number, frame.f_code, frame.f_lasti)
        seen, code, offset = self._seen_backward
        if seen != number:  # it ran and ended between two looks: its line was not seen
            return Collective(number, "backward", site=""), False
        return Collective(number, "backward", code=code, offset=offset), frame is not None

    def position(self) -> tuple[int, bool]:
        """(sequence number, inside) of the last collective entered: changes whenever it does; cheap to compare."""
        return self._seq, self._inside

    # -- publishing ----------------------------------------------------------------------------------------
    def publish(self, store: Any) -> None:
        """Write the record, with the next heartbeat value, through `store` (one request); nothing once finished."""
        with self._publishing:
            if not self._finished:
                self._write(store)

    def _write(self, store: Any) -> None:
        last, inside = self.snapshot()
        self._beat += 1
        record = {
            "last": [last.seq, last.op, last.site] if last else None,
            "inside": inside,
            "state": self._state,
            "error": self._error,
            "pid": self._pid,
            "host": self._host,
            "beat": self._beat,
        }
        store.set(record_key(self.rank), json.dumps(record))

    def finish(self) -> None:
        """Publish that this rank ended (with the error that ended it, if any) and stop publishing. Idempotent."""
        if os.getpid() != self._pid:  # a forked child: the record is its parent's
            return
        with self._publishing:
            if self._finished:
                return
            self._finished = True
            error = self._uncaught_error()
            self._state = "failed" if error is not None else "exited"
            self._error = _short(error) if error is not None else ""
            with contextlib.suppress(Exception):  # the store's host may be gone already
                self._write(self.store)
        # Drop the stores now, not at interpreter finalisation, where freeing rank 0's store server can abort.
        self.store = self.check_store = None

    def _uncaught_error(self) -> BaseException | None:
        # Python sets sys.last_value for an uncaught exception before the exit hooks run; a notebook sets it for
        # every failed cell, so only a value that appeared after this group started ended this rank.
        error = getattr(sys, "last_value", None)
        return None if error is None or error is self._earlier_error else error

    @property
    def finished(self) -> bool:
        """Whether `finish` ran."""
        return self._finished


def own_connection(store: Any) -> Any:
    """A second client of `store` (TCPStore), or the store itself where it cannot be cloned (HashStore, ...)."""
    try:
        return store.clone()
    except Exception:
        return store


def _short(error: BaseException, limit: int = 200) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0] if str(error) else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."

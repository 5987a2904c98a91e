"""Whether another rank runs, on evidence only: its recorded end, or its heartbeat value as this rank sees it.

A heartbeat is a counter the other rank raises at each publication. Only this rank's own `time.monotonic()`
measures how long it stayed the same: no pid is probed (it means nothing on another host or in another PID
namespace) and no other host's clock is read.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from fabric.diagnostics.record import PeerRecord


class Sightings:
    """The heartbeat values this rank saw of each peer: when each value was first seen, and whether it changed."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._first_seen: dict[int, tuple[int, float]] = {}  # rank -> (beat, when first seen)
        self._changed: set[int] = set()

    def see(self, record: PeerRecord) -> None:
        """Note the record's heartbeat value as read now."""
        seen = self._first_seen.get(record.rank)
        if seen is None or seen[0] != record.beat:
            if seen is not None:
                self._changed.add(record.rank)
            self._first_seen[record.rank] = (record.beat, self._clock())

    def changed(self, rank: int) -> bool:
        """Whether the rank's heartbeat moved while this rank watched: it is running."""
        return rank in self._changed

    def silent_for(self, rank: int) -> float:
        """Seconds, on this rank's clock, since its heartbeat value last changed (or since it was first read)."""
        seen = self._first_seen.get(rank)
        return 0.0 if seen is None else self._clock() - seen[1]


def ended(record: PeerRecord) -> str | None:
    """How the rank ended by its own record, or None while it says it runs."""
    if record.state == "failed":
        return f"it failed with {record.error}"
    if record.state == "exited":
        return "it has exited (its script ended)"
    return None


def silence(record: PeerRecord, sightings: Sightings, stale_seconds: float) -> str | None:
    """`it gave no sign of life for N s as seen from this rank`, or None if its heartbeat moved while watched."""
    if sightings.changed(record.rank):
        return None
    seconds = sightings.silent_for(record.rank)
    why = " (killed, crashed or frozen)" if seconds >= stale_seconds else ""
    return f"it gave no sign of life for {seconds:.0f} s as seen from this rank{why}"

"""One message for a collective that timed out or broke: where this rank waits, and where every other rank is."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from fabric.diagnostics.record import HEARTBEAT_SECONDS, Collective, CollectiveRecorder, PeerRecord, record_key

# A heartbeat older than this means the rank stopped publishing (it publishes at least every HEARTBEAT_SECONDS).
STALE_SECONDS = 5 * HEARTBEAT_SECONDS
# How long to wait, after a peer left, for the records to show which one.
SETTLE_SECONDS = 2.0
# Ranks described one by one; the rest are counted (a 1000-rank job must not print 1000 sentences).
_MAX_DESCRIBED = 8
# gloo's and NCCL's words for a collective that ran out of time, and for a peer that left the group.
_TIMEOUT_WORDS = ("timed out", "timeout")
_PEER_LEFT_WORDS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "remote process exited",
    "communicator was aborted",
)


def failure_kind(err: BaseException) -> str | None:
    """'timeout', 'peer_left', 'closed' (by an earlier timeout), or None for errors that say nothing about peers."""
    text = str(err).lower()
    if "pair closure" in text:  # gloo: "Application timeout caused pair closure", at once, after a timeout
        return "closed"
    if any(word in text for word in _TIMEOUT_WORDS):
        return "timeout"
    if any(word in text for word in _PEER_LEFT_WORDS):
        return "peer_left"
    return None


def explain(recorder: CollectiveRecorder, collective: Collective, kind: str, waited: str, setting: str) -> str:
    """`fabric.all_reduce() at train.py:52 (collective #7) timed out after 0:00:15: rank 1 has not arrived; ...`."""
    if kind == "timeout":
        how = f"timed out after {waited}"
        advice = f"To wait longer, pass {setting.replace('...', 'timedelta(minutes=...)')}."
    elif kind == "closed":
        how = "failed at once: an earlier collective timed out, and gloo then closed the connections to the others"
        advice = "The process group cannot be used after a timeout; end the job and fix the first error."
    else:
        how = "failed because another process left the process group"
        advice = "The job cannot go on without it; its own output says why it ended."
    head = f"fabric.{collective.op}() at {collective.site} (collective #{collective.seq}) {how}: "
    return head + describe_peers(recorder, collective, settle=kind == "peer_left") + " " + advice


def describe_peers(recorder: CollectiveRecorder, collective: Collective, settle: bool = False) -> str:
    """Sentences on every other rank: missing ones first, then those waiting at the same collective.

    `settle`: a peer just left. Its sockets close a moment before its process is gone (and before a record
    published at its exit arrives), so look again for up to SETTLE_SECONDS until one rank shows it has ended.
    """
    peers = read_peers(recorder)
    deadline = time.monotonic() + SETTLE_SECONDS
    while settle and not isinstance(peers, str) and not _any_ended(peers) and time.monotonic() < deadline:
        time.sleep(0.05)
        peers = read_peers(recorder)
    if isinstance(peers, str):
        return peers
    missing, waiting = [], []
    for rank, record in sorted(peers.items()):
        if record is not None and _waits_here(record, collective):
            waiting.append(rank)
        else:
            missing.append(_describe(rank, record, collective))
    sentences = missing[:_MAX_DESCRIBED]
    if len(missing) > _MAX_DESCRIBED:
        sentences.append(f"{len(missing) - _MAX_DESCRIBED} more ranks are not at this collective either")
    if waiting and not missing:
        sentences.append(
            "every other rank is waiting at this collective too, so none is missing: the connection between the "
            "processes failed or is too slow"
        )
    elif waiting:
        sentences.append(f"{_ranks(waiting)} waiting at this collective too")
    return "; ".join(sentences) + "."


def read_peers(recorder: CollectiveRecorder) -> dict[int, PeerRecord | None] | str:
    """Every other rank's record (None: it published none), or why they cannot be read."""
    store = recorder.store
    if store is None:
        return "this rank had already finished, so the other ranks' records are not available"
    peers: dict[int, PeerRecord | None] = {}
    try:
        for rank in range(recorder.world_size):
            if rank == recorder.rank:
                continue
            key = record_key(rank)
            peers[rank] = PeerRecord.decode(rank, store.get(key)) if store.check([key]) else None
    except Exception:
        return (
            "the other ranks' records could not be read, because the rendezvous store does not answer: the process "
            "hosting it (rank 0 under fabric's launchers; the launcher under torchrun) has ended or is unreachable"
        )
    return peers


def _any_ended(peers: dict[int, PeerRecord | None]) -> bool:
    return any(record is not None and liveness(record) is not None for record in peers.values())


def _waits_here(record: PeerRecord, collective: Collective) -> bool:
    last = record.last
    alive = record.state == "running" and liveness(record) is None
    return alive and last is not None and last.seq == collective.seq and last.op == collective.op and record.inside


def _describe(rank: int, record: PeerRecord | None, collective: Collective) -> str:
    if record is None:
        return f"rank {rank} has published no record (it has not joined fabric's process group setup)"
    last = record.last
    if last is None:
        where = f"rank {rank} has not arrived; it has issued no fabric collective yet"
    elif last.seq < collective.seq:
        where = f"rank {rank} has not arrived; its last collective was {last.describe()}"
    elif last.seq == collective.seq and last.op == collective.op:
        where = f"rank {rank} is at the same collective ({last.describe()})"
    else:
        where = (
            f"rank {rank} is at {last.describe()} instead, so the ranks' collectives diverged "
            "(FABRIC_DEBUG_COLLECTIVES=1 stops at the first difference)"
        )
    return f"{where} and {liveness(record) or _running(record, last, collective)}"


def _running(record: PeerRecord, last: Collective | None, collective: Collective) -> str:
    if last is not None and record.inside and last.seq < collective.seq:
        return "it is still running, waiting inside that collective"
    return "it is still running"


def liveness(record: PeerRecord, stale_seconds: float = STALE_SECONDS) -> str | None:
    """Why the rank is not running any more, or None if it still seems to be (no heartbeat for `stale_seconds`
    counts as not running)."""
    if record.state == "failed":
        return f"it exited with an error ({record.error})"
    if record.state == "exited":
        return "it has exited (its script ended)"
    if record.host == socket.gethostname() and not _pid_running(record.pid):
        return (
            f"it is no longer running: its process (pid {record.pid}) ended without recording an exit, so it was "
            "killed (e.g. SIGKILL, the out-of-memory killer) or crashed"
        )
    age = time.time() - record.heartbeat
    if age > stale_seconds:
        return f"it has given no sign of life for {age:.0f} s (killed, crashed or frozen)"
    return None


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # an exited child that its parent has not reaped yet still exists, as a zombie
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (macOS): os.kill said it exists


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]} is"
    shown = ", ".join(str(rank) for rank in ranks[:_MAX_DESCRIBED])
    more = f" and {len(ranks) - _MAX_DESCRIBED} more" if len(ranks) > _MAX_DESCRIBED else ""
    return f"ranks {shown}{more} are"

"""One message for a collective that timed out or broke: where this rank waits, and where every other rank is."""

from __future__ import annotations

import time

from fabric.diagnostics.record import Collective, CollectiveRecorder, PeerRecord, record_key
from fabric.health.liveness import Sightings, ended, silence

# Beyond how often peers publish, how long to watch their heartbeats before saying one gave no sign of life.
SETTLE_SECONDS = 0.5
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
    return head + describe_peers(recorder, collective, peer_left=kind == "peer_left") + " " + advice


def describe_peers(recorder: CollectiveRecorder, collective: Collective, peer_left: bool = False) -> str:
    """Sentences on every other rank: missing ones first, then those waiting at the same collective.

    The heartbeats of the ranks that say they run are watched until each one moved, or for two publication
    periods: only a heartbeat that moved shows a rank is running, and only this rank's clock measures it.
    `peer_left`: a peer just left; also watch (as long) for the record in which one says it ended.
    """
    sightings = Sightings()
    peers = _watch(recorder, sightings, peer_left)
    if isinstance(peers, str):
        return peers
    missing, waiting = [], []
    for rank, record in sorted(peers.items()):
        if record is not None and _waits_here(record, collective, sightings):
            waiting.append(rank)
        else:
            missing.append(_describe(rank, record, collective, sightings, recorder.stale_seconds))
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


def _watch(recorder: CollectiveRecorder, sightings: Sightings, peer_left: bool) -> dict[int, PeerRecord | None] | str:
    """Read the peers' records until every rank that says it runs showed a moving heartbeat, or time is up."""
    period = recorder.heartbeat_seconds
    deadline = time.monotonic() + 2 * period + SETTLE_SECONDS
    while True:
        peers = read_peers(recorder)
        if isinstance(peers, str):
            return peers
        for record in peers.values():
            if record is not None:
                sightings.see(record)
        records = [record for record in peers.values() if record is not None]
        unsure = [r for r in records if ended(r) is None and not sightings.changed(r.rank)]
        one_ended = any(ended(record) is not None for record in records)
        if (not unsure and (one_ended or not peer_left)) or time.monotonic() >= deadline:
            return peers
        time.sleep(min(period / 2, max(0.0, deadline - time.monotonic())))


def read_peers(recorder: CollectiveRecorder) -> dict[int, PeerRecord | None] | str:
    """Every other rank's record (None: it published none), or why they cannot be read."""
    store = recorder.store
    if store is None:
        return "this rank had already finished, so the other ranks' records are not available"
    ranks = [rank for rank in range(recorder.world_size) if rank != recorder.rank]
    keys = [record_key(rank) for rank in ranks]
    peers: dict[int, PeerRecord | None] = {}
    try:
        if keys and store.check(keys):  # two requests for the whole job while every rank has published
            for rank, raw in zip(ranks, store.multi_get(keys), strict=True):
                peers[rank] = PeerRecord.decode(rank, raw)
            return peers
        for rank, key in zip(ranks, keys, strict=True):
            peers[rank] = PeerRecord.decode(rank, store.get(key)) if store.check([key]) else None
    except Exception:
        return (
            "the other ranks' records could not be read, because the rendezvous store does not answer: the process "
            "hosting it (rank 0 under fabric's launchers; the launcher under torchrun) has ended or is unreachable"
        )
    return peers


def _waits_here(record: PeerRecord, collective: Collective, sightings: Sightings) -> bool:
    last = record.last
    alive = ended(record) is None and sightings.changed(record.rank)
    return alive and last is not None and last.seq == collective.seq and last.op == collective.op and record.inside


def _describe(
    rank: int, record: PeerRecord | None, collective: Collective, sightings: Sightings, stale_seconds: float
) -> str:
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
    state = ended(record) or silence(record, sightings, stale_seconds) or _running(record, last, collective)
    return f"{where} and {state}"


def _running(record: PeerRecord, last: Collective | None, collective: Collective) -> str:
    if last is not None and record.inside and last.seq < collective.seq:
        return "it is still running, waiting inside that collective"
    return "it is still running"


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]} is"
    shown = ", ".join(str(rank) for rank in ranks[:_MAX_DESCRIBED])
    more = f" and {len(ranks) - _MAX_DESCRIBED} more" if len(ranks) > _MAX_DESCRIBED else ""
    return f"ranks {shown}{more} are"

"""FABRIC_DEBUG_COLLECTIVES: before each collective, every rank compares what it is about to issue with the others.

The comparison goes through the rendezvous store, not the process group, so it works whatever the ranks issue.
"""

from __future__ import annotations

import contextlib
import json
import re
from datetime import timedelta
from typing import Any

from fabric.diagnostics.record import Collective, CollectiveRecorder

_KEY = "fabric/diag/check/{seq}/{rank}"
_READ_KEY = "fabric/diag/check-read/{seq}/{rank}"
_READ_WAIT = timedelta(seconds=10)


class CollectiveMismatchError(RuntimeError):
    """The ranks were about to issue different collectives (raised on every rank)."""


def signature(op: str, args: tuple[Any, ...]) -> str:
    """`all_reduce(float32[2, 3], sum)`: what must be equal on every rank for the collective to be valid."""
    return f"{op}({', '.join(_describe(arg) for arg in args)})"


def _describe(arg: Any) -> str:
    shape, dtype = getattr(arg, "shape", None), getattr(arg, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{str(dtype).removeprefix('torch.')}{list(shape)}"
    return str(arg)


def check_same_collective(recorder: CollectiveRecorder, collective: Collective, args: tuple[Any, ...]) -> None:
    """Publish this rank's collective, wait for every rank's, and raise on every rank if they differ.

    A rank that never arrives makes the store's wait time out, which the caller explains as a hang.
    """
    store = recorder.check_store
    if store is None:
        return
    mine = json.dumps({"sig": signature(collective.op, args), "site": collective.site})
    store.set(_KEY.format(seq=collective.seq, rank=recorder.rank), mine)
    keys = [_KEY.format(seq=collective.seq, rank=rank) for rank in range(recorder.world_size)]
    store.wait(keys)  # the store's timeout is the collective timeout
    entries = [json.loads(raw) for raw in store.multi_get(keys)]
    if collective.seq > 1:
        # Every rank wrote this collective's key, so every rank has read the previous one: free it.
        store.delete_key(_KEY.format(seq=collective.seq - 1, rank=recorder.rank))
    if any(entry["sig"] != entries[0]["sig"] for entry in entries):
        # Every rank raises now and may exit, rank 0 with the store's server: first wait until every rank has
        # read the entries (a slower rank would otherwise find the server gone and fail with a network error).
        store.set(_READ_KEY.format(seq=collective.seq, rank=recorder.rank), "1")
        read = [_READ_KEY.format(seq=collective.seq, rank=rank) for rank in range(recorder.world_size)]
        with contextlib.suppress(Exception):  # bounded: a rank that died meanwhile must not keep the others here
            store.wait(read, _READ_WAIT)
        raise CollectiveMismatchError(_mismatch_message(collective.seq, entries))


def _mismatch_message(seq: int, entries: list[dict[str, str]]) -> str:
    groups: dict[tuple[str, str], list[int]] = {}
    for rank, entry in enumerate(entries):
        groups.setdefault((entry["sig"], entry["site"]), []).append(rank)
    parts = [f"{_ranks(ranks)} {sig} at {site}" for (sig, site), ranks in groups.items()]
    return (
        f"FABRIC_DEBUG_COLLECTIVES: the ranks issue different collectives as collective #{seq}: "
        + "; ".join(parts)
        + ". Every rank must issue the same collectives in the same order, with the same shapes and dtypes "
        "(gloo and NCCL would otherwise hang, fail or return wrong values). "
        + (_UNEVEN_FIX if _only_shapes_differ(entries) else _SAME_CALL_FIX)
    )


_SAME_CALL_FIX = "Make every rank reach the same call with the same kind of tensor."
_UNEVEN_FIX = (
    "fabric.all_gather(data) gathers tensors of one shape (as Lightning Fabric and torch do); for tensors whose "
    "shape differs between ranks (the last batch of an evaluation, a variable number of predictions) call "
    "fabric.all_gather(data, uneven=True), which returns a list of every rank's tensor where the shapes differ."
)


def _only_shapes_differ(entries: list[dict[str, str]]) -> bool:
    """Whether every rank gathers with all_gather and only the tensors' sizes differ (same dtypes, same ranks)."""
    sigs = [entry["sig"] for entry in entries]
    if not all(sig.startswith("all_gather(") for sig in sigs):
        return False
    without_sizes = {re.sub(r"\[[\d, ]*\]", "[]", sig) for sig in sigs}
    return len(without_sizes) == 1


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]} calls" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} call"

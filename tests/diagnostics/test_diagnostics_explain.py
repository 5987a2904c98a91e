"""The hang message from the records ranks publish: every case of where a peer can be, and whether it runs."""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from fabric.diagnostics import explain as explain_module
from fabric.diagnostics.explain import explain, failure_kind
from fabric.diagnostics.record import Collective, CollectiveRecorder, PeerRecord, record_key

HERE = Collective(7, "all_reduce", "train.py:52")
SETTING = "DDPStrategy(timeout=...)"
ADVICE = "To wait longer, pass DDPStrategy(timeout=timedelta(minutes=...))."


class _Group:
    """Stands for a process group (the recorder keeps only a weak reference to it)."""


class _PublishingStore:
    """A HashStore whose running ranks publish between two reads: each read sees their heartbeat one higher.

    Ranks in `silent` publish nothing more (killed, frozen): their heartbeat stays the same.
    """

    def __init__(self) -> None:
        self._store = dist.HashStore()
        self.silent: set[int] = set()
        self._reads = 0

    def set(self, key: str, value: str) -> None:
        self._store.set(key, value)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def get(self, key: str) -> bytes:
        return self._bump(key, self._store.get(key))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self._bump(key, raw) for key, raw in zip(keys, self._store.multi_get(keys), strict=True)]

    def _bump(self, key: str, raw: bytes) -> bytes:
        record = json.loads(raw)
        self._reads += 1
        if int(key.rsplit("/", 1)[1]) not in self.silent:
            record["beat"] += self._reads
        return json.dumps(record).encode()


@pytest.fixture(autouse=True)
def _short_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(explain_module, "SETTLE_SECONDS", 0.05)


@pytest.fixture
def store() -> Any:
    return _PublishingStore()


def _recorder(store: Any, world_size: int) -> Iterator[CollectiveRecorder]:
    recorder = CollectiveRecorder(store, 0, world_size, _Group(), debug=False)
    recorder.heartbeat_seconds = 0.01
    yield recorder
    recorder.finish()


@pytest.fixture
def world2(store: Any) -> Iterator[CollectiveRecorder]:
    yield from _recorder(store, 2)


@pytest.fixture
def world4(store: Any) -> Iterator[CollectiveRecorder]:
    yield from _recorder(store, 4)


def _publish(store: Any, rank: int, last: tuple[int, str, str] | None, **fields: Any) -> None:
    record = {"last": list(last) if last else None, "inside": True, "state": "running", "error": "",
              "pid": os.getpid(), "host": socket.gethostname(), "beat": 1}  # fmt: skip
    record.update(fields)
    store.set(record_key(rank), json.dumps(record))


def test_missing_rank_first_then_the_ranks_waiting_here(store: Any, world4: CollectiveRecorder) -> None:
    _publish(store, 1, (6, "barrier", "train.py:40"), inside=False)
    for rank in (2, 3):
        _publish(store, rank, (7, "all_reduce", "train.py:52"))
    assert explain(world4, HERE, "timeout", "0:00:15", SETTING) == (
        "fabric.all_reduce() at train.py:52 (collective #7) timed out after 0:00:15: rank 1 has not arrived; its "
        "last collective was #6 barrier() at train.py:40 and it is still running; ranks 2, 3 are waiting at this "
        f"collective too. {ADVICE}"
    )


def test_rank_stuck_inside_an_earlier_collective(store: Any, world2: CollectiveRecorder) -> None:
    _publish(store, 1, (6, "broadcast", "train.py:41"), inside=True)
    message = explain(world2, HERE, "timeout", "0:00:15", SETTING)
    assert "its last collective was #6 broadcast() at train.py:41 and it is still running, waiting inside" in message


def test_every_rank_waiting_means_none_is_missing(store: Any, world4: CollectiveRecorder) -> None:
    for rank in (1, 2, 3):
        _publish(store, rank, (7, "all_reduce", "train.py:52"))
    assert "every other rank is waiting at this collective too, so none is missing" in explain(
        world4, HERE, "timeout", "0:00:15", SETTING
    )


def test_rank_at_another_collective_means_they_diverged(store: Any, world2: CollectiveRecorder) -> None:
    _publish(store, 1, (7, "barrier", "train.py:60"))
    assert (
        "rank 1 is at #7 barrier() at train.py:60 instead, so the ranks' collectives diverged "
        "(FABRIC_DEBUG_COLLECTIVES=1 stops at the first difference) and it is still running."
    ) in explain(world2, HERE, "timeout", "0:00:15", SETTING)


def test_rank_that_raised_is_named_with_its_error(store: Any, world2: CollectiveRecorder) -> None:
    _publish(store, 1, (6, "barrier", "train.py:40"), state="failed", error="ValueError: bad batch")
    message = explain(world2, HERE, "peer_left", "0:00:15", SETTING)
    assert message == (
        "fabric.all_reduce() at train.py:52 (collective #7) failed because another process left the process group: "
        "rank 1 has not arrived; its last collective was #6 barrier() at train.py:40 and it failed with "
        "ValueError: bad batch. The job cannot go on without it; its own output says why it ended."
    )


def test_silent_rank_gave_no_sign_of_life_as_seen_from_this_rank(store: Any, world2: CollectiveRecorder) -> None:
    store.silent.add(1)  # killed, or left with os._exit: its record still says "running"
    _publish(store, 1, (6, "barrier", "train.py:40"))
    message = explain(world2, HERE, "peer_left", "0:00:15", SETTING)
    assert "its last collective was #6 barrier() at train.py:40 and it gave no sign of life for 0 s as seen from " in (
        message
    )


def test_pid_and_host_of_a_peer_are_never_probed(store: Any, world2: CollectiveRecorder) -> None:
    # A peer in another PID namespace on this host (a container): its pid is not a process here.
    _publish(store, 1, (6, "barrier", "train.py:40"), inside=False, pid=2**22 + 7)
    message = explain(world2, HERE, "timeout", "0:00:15", SETTING)
    assert "its last collective was #6 barrier() at train.py:40 and it is still running." in message


def test_rank_without_record_and_rank_without_collectives(store: Any, world4: CollectiveRecorder) -> None:
    _publish(store, 1, None)
    _publish(store, 2, (7, "all_reduce", "train.py:52"))
    message = explain(world4, HERE, "timeout", "0:00:15", SETTING)
    assert "rank 1 has not arrived; it has issued no fabric collective yet and it is still running" in message
    assert "rank 3 has published no record (it has not joined fabric's process group setup)" in message
    assert "rank 2 is waiting at this collective too." in message


def test_many_missing_ranks_are_counted_not_listed(store: Any) -> None:
    for recorder in _recorder(store, 12):
        for rank in range(1, 12):
            _publish(store, rank, (6, "barrier", "train.py:40"), inside=False)
        message = explain(recorder, HERE, "timeout", "0:00:15", SETTING)
        assert message.count("has not arrived") == 8
        assert "; 3 more ranks are not at this collective either." in message


def test_unreadable_store_says_its_host_has_ended(world2: CollectiveRecorder) -> None:
    class _GoneStore:
        def check(self, keys: list[str]) -> bool:
            raise RuntimeError("Connection reset by peer")

    world2.store = _GoneStore()
    assert "the other ranks' records could not be read, because the rendezvous store does not answer" in explain(
        world2, HERE, "timeout", "0:00:15", SETTING
    )


def test_gloo_closing_after_a_timeout_is_not_a_second_timeout(store: Any, world2: CollectiveRecorder) -> None:
    _publish(store, 1, (6, "barrier", "train.py:40"), inside=False)
    message = explain(world2, HERE, "closed", "0:00:15", SETTING)
    assert "(collective #7) failed at once: an earlier collective timed out, and gloo then closed" in message


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("[gloo/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete", "timeout"),
        ("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE)", "timeout"),
        ("[gloo/pair.cc:534] Connection closed by peer [127.0.0.1]:43761", "peer_left"),
        ("[gloo/pair.cc:598] Read error [127.0.0.1]:3003: Connection reset by peer", "peer_left"),
        ("[../third_party/gloo/gloo/transport/tcp/pair.cc:144] Application timeout caused pair closure", "closed"),
        ("Tensors must be contiguous", None),
    ],
)
def test_failure_kind(text: str, kind: str | None) -> None:
    assert failure_kind(RuntimeError(text)) == kind


def test_recorder_publishes_a_rising_heartbeat_and_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    store = dist.HashStore()
    recorder = CollectiveRecorder(store, 1, 2, _Group(), debug=False)
    start = PeerRecord.decode(1, store.get(record_key(1)))
    assert (start.last, start.state, start.pid, start.beat) == (None, "running", os.getpid(), 1)
    recorder.publish(store)  # a tick of the health thread
    assert PeerRecord.decode(1, store.get(record_key(1))).beat == 2
    here = sys._getframe()
    seq = recorder.enter("barrier", here.f_code, here.f_lasti)
    collective = recorder.snapshot()[0]
    assert collective == Collective(1, "barrier", f"test_diagnostics_explain.py:{_line_of('recorder.enter(')}")
    recorder.leave(seq)
    monkeypatch.setattr(sys, "last_value", ValueError("bad batch"), raising=False)
    recorder.finish()
    end = PeerRecord.decode(1, store.get(record_key(1)))
    assert (end.last, end.inside, end.state, end.error, end.beat) == (
        collective,
        False,
        "failed",
        "ValueError: bad batch",
        3,
    )
    assert recorder.finished and recorder.store is None
    recorder.publish(store)  # the health thread, one tick late: the end stays published
    assert PeerRecord.decode(1, store.get(record_key(1))).state == "failed"


def test_an_error_a_notebook_cell_left_before_the_group_started_is_no_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "last_value", ZeroDivisionError("an earlier cell"), raising=False)
    store = dist.HashStore()
    recorder = CollectiveRecorder(store, 1, 2, _Group(), debug=False)
    recorder.finish()
    assert PeerRecord.decode(1, store.get(record_key(1))).state == "exited"


def _line_of(text: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(n for n, line in enumerate(lines, start=1) if text in line and "_line_of" not in line)

"""The hang message from the records ranks publish: every case of where a peer can be, and whether it runs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from fabric.diagnostics.explain import explain, failure_kind
from fabric.diagnostics.record import Collective, CollectiveRecorder, PeerRecord, record_key

HERE = Collective(7, "all_reduce", "train.py:52")
SETTING = "DDPStrategy(timeout=...)"
ADVICE = "To wait longer, pass DDPStrategy(timeout=timedelta(minutes=...))."


class _Group:
    """Stands for a process group (the recorder keeps only a weak reference to it)."""


@pytest.fixture
def store() -> Any:
    return dist.HashStore()


def _recorder(store: Any, world_size: int) -> Iterator[CollectiveRecorder]:
    recorder = CollectiveRecorder(store, 0, world_size, _Group(), debug=False)
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
              "pid": os.getpid(), "host": socket.gethostname(), "heartbeat": time.time()}  # fmt: skip
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
        "rank 1 has not arrived; its last collective was #6 barrier() at train.py:40 and it exited with an error "
        "(ValueError: bad batch). The job cannot go on without it; its own output says why it ended."
    )


def test_dead_process_on_this_machine_is_no_longer_running(store: Any, world2: CollectiveRecorder) -> None:
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(ended.stdout)
    _publish(store, 1, (6, "barrier", "train.py:40"), pid=pid)
    assert (
        f"and it is no longer running: its process (pid {pid}) ended without recording an exit, so it was killed"
    ) in explain(world2, HERE, "timeout", "0:00:15", SETTING)


def test_silent_rank_on_another_machine_gave_no_sign_of_life(store: Any, world2: CollectiveRecorder) -> None:
    _publish(store, 1, (6, "barrier", "train.py:40"), host="elsewhere", heartbeat=time.time() - 60)
    message = explain(world2, HERE, "timeout", "0:00:15", SETTING)
    assert "and it has given no sign of life for 60 s (killed, crashed or frozen)." in message


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


def test_recorder_publishes_at_start_and_its_end(store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = CollectiveRecorder(store, 1, 2, _Group(), debug=False)
    start = PeerRecord.decode(1, store.get(record_key(1)))
    assert (start.last, start.state, start.pid) == (None, "running", os.getpid())
    here = sys._getframe()
    seq = recorder.enter("barrier", here.f_code, here.f_lasti)
    collective = recorder.snapshot()[0]
    assert collective == Collective(1, "barrier", f"test_diagnostics_explain.py:{_line_of('recorder.enter(')}")
    recorder.leave(seq)
    monkeypatch.setattr(sys, "last_value", ValueError("bad batch"), raising=False)
    recorder.finish()
    end = PeerRecord.decode(1, store.get(record_key(1)))
    assert (end.last, end.inside, end.state, end.error) == (collective, False, "failed", "ValueError: bad batch")
    assert recorder.finished and recorder.store is None


def _line_of(text: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(n for n, line in enumerate(lines, start=1) if text in line and "_line_of" not in line)

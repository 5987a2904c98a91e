"""Recording around a collective, the debug-mode comparison, and the FABRIC_DEBUG_COLLECTIVES switch."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fabric.diagnostics import track
from fabric.diagnostics.callsite import call_site, caller_outside_fabric
from fabric.diagnostics.check import CollectiveMismatchError, check_same_collective, signature
from fabric.diagnostics.record import Collective, CollectiveRecorder, PeerRecord, record_key
from fabric.environments.default import find_free_port
from fabric.precision.precision import Precision
from fabric.utilities.exceptions import FabricValueError


class _Group:
    """Stands for a process group."""


@pytest.fixture
def one_rank_group() -> Iterator[Any]:
    """A real gloo group of one process, with the TCP store a launched job has."""
    store = dist.TCPStore("127.0.0.1", find_free_port(), 1, is_master=True, timeout=timedelta(seconds=10))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield store
    track.stop_recording()
    dist.destroy_process_group()


def test_debug_switch_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(track.DEBUG_VARIABLE, raising=False)
    assert not track.debug_enabled()
    monkeypatch.setenv(track.DEBUG_VARIABLE, "1")
    assert track.debug_enabled()
    monkeypatch.setenv(track.DEBUG_VARIABLE, "0")
    assert not track.debug_enabled()
    monkeypatch.setenv(track.DEBUG_VARIABLE, "detail")
    with pytest.raises(FabricValueError, match=r"FABRIC_DEBUG_COLLECTIVES='detail': not a switch\. Set it to 1"):
        track.debug_enabled()


def test_call_site_is_the_first_frame_outside_fabric() -> None:
    line, site = sys._getframe().f_lineno, call_site()
    assert site == f"test_diagnostics_track.py:{line}"


def test_the_recorded_site_is_the_users_line_above_every_fabric_frame(one_rank_group: Any) -> None:
    recorder = track.start_recording()
    assert recorder is not None
    # A function of fabric's own (by its file) between this test and the collective, as Fabric's methods are.
    source = "def through_fabric():\n    with track.collective('barrier', words):\n        pass\n"
    scope: dict[str, Any] = {"track": track, "words": _words}
    exec(compile(source, str(Path(track.__file__).parent / "_method.py"), "exec"), scope)
    line = sys._getframe().f_lineno + 1
    scope["through_fabric"]()
    last, inside = recorder.snapshot()
    assert last is not None and not inside
    assert last.site == f"test_diagnostics_track.py:{line}"


def test_the_search_starts_at_the_given_depth_and_stops_at_the_stacks_top() -> None:
    assert caller_outside_fabric(0) is sys._getframe()
    assert caller_outside_fabric(10_000) is None  # past the stack's top: nothing outside fabric there


def test_signature_names_dtype_shape_and_options() -> None:
    tensor = torch.ones(2, 3, dtype=torch.float16)
    assert signature("all_reduce", (tensor, "sum")) == "all_reduce(float16[2, 3], sum)"
    assert signature("barrier", ()) == "barrier()"


def _words() -> tuple[str, str]:
    return "0:00:03", "DDPStrategy(timeout=...)"


def test_without_a_recorder_the_plain_timeout_message_remains() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError) as info, track.collective("barrier", _words):
        raise RuntimeError("Timed out waiting 3000ms for recv operation to complete")
    assert info.value.__notes__[-1].startswith("fabric.barrier() timed out after 0:00:03 waiting for the other")


def test_a_cached_recorder_of_a_destroyed_group_does_not_explain_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    # After destroy_process_group both the cache's dead weak reference and dist.group.WORLD are None. The hot path
    # may still count into the stale record (nobody reads it); a failure's explanation must not come from it.
    class Stale:
        debug = False

        def enter(self, *args: Any) -> int:
            return 5

        def leave(self, seq: int) -> None:
            pass

        def entered(self, *args: Any) -> Any:
            pytest.fail("a finished group's recorder explained a failure")

    monkeypatch.setattr(track, "_LAST", [lambda: None, Stale()])
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError) as info, track.collective("barrier", _words):
        raise RuntimeError("Timed out waiting 3000ms for recv operation to complete")
    assert info.value.__notes__[-1].startswith("fabric.barrier() timed out after 0:00:03 waiting for the other")


def test_recording_on_a_real_group(one_rank_group: Any) -> None:
    recorder = track.start_recording()
    assert recorder is not None and track.start_recording() is recorder, "one recorder per group"
    with track.collective("all_reduce", _words, (torch.ones(1), "sum")):
        dist.all_reduce(torch.ones(1))
    line = sys._getframe().f_lineno + 1
    with pytest.raises(dist.DistBackendError) as info, track.collective("barrier", _words):
        raise dist.DistBackendError("Timed out waiting 3000ms for recv operation to complete")
    # torch's error of torch's type (a user's retry code catches it as before), explained in a note.
    assert str(info.value) == "Timed out waiting 3000ms for recv operation to complete"
    assert info.value.__notes__[-1].startswith(f"fabric.barrier() at test_diagnostics_track.py:{line} (collective #2)")
    assert recorder.position() == (2, False), "left in a finally: a failed collective is not still waited in"
    track.stop_recording()
    record = PeerRecord.decode(0, dist.distributed_c10d._get_default_store().get(record_key(0)))
    assert record.state == "exited"
    assert record.last == Collective(2, "barrier", f"test_diagnostics_track.py:{line}")


def test_a_counted_backward_takes_a_number_among_the_collectives(one_rank_group: Any) -> None:
    recorder = track.start_recording()
    assert recorder is not None and track.backward_counter() is recorder
    with track.collective("barrier", _words):
        pass
    recorder.backwards += 2  # two backward passes, counted as Fabric.backward counts them
    assert track.enter("all_reduce") == 4
    track.leave(4)
    assert recorder.position() == (4, False)


def test_a_counted_backward_is_found_running_with_its_line(one_rank_group: Any) -> None:
    recorder = track.start_recording()
    assert recorder is not None
    entered, release = threading.Event(), threading.Event()

    class Blocks(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # not fabric's: the search goes past it
            entered.set()
            release.wait(30)
            return grad

    loss = Blocks.apply(torch.ones(2, requires_grad=True)).sum()
    line = sys._getframe().f_lineno + 1
    training = threading.Thread(target=lambda: Precision().backward(loss, None))  # a backward of fabric's
    recorder.backwards += 1
    training.start()
    try:
        assert entered.wait(30)
        site = f"test_diagnostics_track.py:{line}"
        assert recorder.snapshot() == (Collective(1, "backward", site), True), "seen in the training thread's stack"
    finally:
        release.set()
        training.join(30)
    assert recorder.snapshot() == (Collective(1, "backward", site), False), "ended: its line was seen, and kept"
    recorder.backwards += 1  # one that ran and ended between two looks: its line is not known
    recorder.publish(one_rank_group)
    record = PeerRecord.decode(0, one_rank_group.get(record_key(0)))
    assert record.last is not None and record.last.describe() == "#2 backward()" and not record.inside


def test_a_counted_backward_that_times_out_is_explained_as_a_collective(one_rank_group: Any) -> None:
    recorder = track.start_recording()
    assert recorder is not None
    with track.collective("barrier", _words):
        pass
    recorder.backwards += 1  # as Fabric.backward counts before calling torch's backward
    timeout = RuntimeError("Timed out waiting 3000ms for recv operation to complete")
    line = sys._getframe().f_lineno + 1
    track.backward_failed(timeout, recorder, _words)
    assert timeout.__notes__[-1].startswith(
        f"fabric.backward() at test_diagnostics_track.py:{line} (collective #2) timed out after 0:00:03: "
    )
    stale = RuntimeError("Timed out waiting 3000ms for recv operation to complete")
    track.backward_failed(stale, object(), _words)  # counted by another group's recorder: no record to read
    assert stale.__notes__[-1].startswith("fabric.backward() timed out after 0:00:03 waiting for the other")


def test_errors_that_say_nothing_about_peers_pass_through(one_rank_group: Any) -> None:
    track.start_recording()
    with pytest.raises(RuntimeError, match=r"^Tensors must be contiguous$") as info, track.collective("x", _words):
        raise RuntimeError("Tensors must be contiguous")
    assert not hasattr(info.value, "__notes__")


def test_debug_mode_warns_that_subgroups_are_not_compared(one_rank_group: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(track.DEBUG_VARIABLE, "1")
    track.start_recording()
    subgroup = dist.new_group([0])
    with (
        pytest.warns(UserWarning, match=r"fabric\.all_reduce\(group=\.\.\.\) runs on a subgroup; only collectives"),
        track.collective("all_reduce", _words, group=subgroup),
    ):
        dist.all_reduce(torch.ones(1), group=subgroup)


def _recorder(store: Any) -> CollectiveRecorder:
    return CollectiveRecorder(store, 0, 2, _Group(), debug=True)


def _peer_entry(store: Any, seq: int, sig: str, site: str = "train.py:9") -> None:
    store.set(f"fabric/diag/check/{seq}/1", json.dumps({"sig": sig, "site": site}))
    store.set(f"fabric/diag/check-read/{seq}/1", "1")  # on a mismatch, rank 1 has read the entries too


def test_check_passes_when_every_rank_issues_the_same() -> None:
    store = dist.HashStore()
    recorder = _recorder(store)
    for seq in (1, 2):
        _peer_entry(store, seq, "all_reduce(float32[2], sum)")
        check_same_collective(recorder, Collective(seq, "all_reduce", "train.py:9"), (torch.ones(2), "sum"))
    assert not store.check(["fabric/diag/check/1/0"]), "an entry every rank has read is freed"
    recorder.finish()


def test_check_raises_with_both_call_sites() -> None:
    store = dist.HashStore()
    recorder = _recorder(store)
    _peer_entry(store, 1, "barrier()", site="train.py:40")
    with pytest.raises(CollectiveMismatchError) as info:
        check_same_collective(recorder, Collective(1, "all_reduce", "train.py:52"), (torch.ones(2, 3), "mean"))
    assert str(info.value).startswith(
        "FABRIC_DEBUG_COLLECTIVES: the ranks issue different collectives as collective #1: rank 0 calls "
        "all_reduce(float32[2, 3], mean) at train.py:52; rank 1 calls barrier() at train.py:40. Every rank must"
    )
    recorder.finish()


def test_debug_mode_warns_when_the_group_has_no_usable_store(
    one_rank_group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(track.DEBUG_VARIABLE, "1")
    monkeypatch.setattr(track, "_default_store", lambda: None)
    with pytest.warns(UserWarning, match=r"FABRIC_DEBUG_COLLECTIVES=1: the process group has no rendezvous store"):
        assert track.start_recording() is None


def test_the_hot_path_resolves_no_call_site_until_one_is_read(
    one_rank_group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fabric.diagnostics import record

    resolved: list[int] = []
    real = record.site_text
    monkeypatch.setattr(record, "site_text", lambda code, offset: resolved.append(offset) or real(code, offset))
    recorder = track.start_recording()
    assert recorder is not None
    for _ in range(100):
        with track.collective("all_reduce", _words, (torch.ones(1), "sum")):
            line = sys._getframe().f_lineno
    assert resolved == [], "a healthy collective makes no file:line text"
    last, inside = recorder.snapshot()
    assert last is not None and not inside and last.seq == 100
    assert last.site == f"test_diagnostics_track.py:{line - 1}" and len(resolved) == 1


def test_debug_check_waits_on_its_own_store_connection(one_rank_group: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(track.DEBUG_VARIABLE, "1")
    recorder = track.start_recording()
    assert recorder is not None and recorder.check_store is not None
    assert recorder.check_store is not recorder.store, "the shared default-store client stays free meanwhile"
    with track.collective("all_reduce", _words, (torch.ones(1), "sum")):
        pass
    assert recorder.check_store.check(["fabric/diag/check/1/0"])


def test_a_gather_whose_shapes_differ_names_the_uneven_opt_in() -> None:
    store = dist.HashStore()
    recorder = _recorder(store)
    _peer_entry(store, 1, "all_gather(float32[3, 4])")
    with pytest.raises(CollectiveMismatchError) as info:
        check_same_collective(recorder, Collective(1, "all_gather", "eval.py:9"), (torch.ones(2, 4),))
    assert "rank 0 calls all_gather(float32[2, 4]) at eval.py:9; rank 1 calls all_gather(float32[3, 4])" in str(
        info.value
    )
    assert "call fabric.all_gather(data, uneven=True), which returns a list" in str(info.value)
    _peer_entry(store, 2, "all_gather(float64[2, 4])")  # another dtype: not a matter of shapes
    with pytest.raises(CollectiveMismatchError) as info:
        check_same_collective(recorder, Collective(2, "all_gather", "eval.py:9"), (torch.ones(2, 4),))
    assert "uneven=True" not in str(info.value)
    recorder.finish()


def test_nccl_turns_on_torchs_flight_recorder_unless_the_user_chose() -> None:
    old = (2, 10, 0)  # torch <= 2.10: the recorder is off unless TORCH_NCCL_TRACE_BUFFER_SIZE is set
    env: dict[str, str] = {}
    assert track.prepare_torch_env("nccl", env, old) == ["TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT"]
    assert env == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert track.flight_recorder_dumps(env) == "/tmp/nccl_trace_rank_"
    mine = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_FR_DUMP_TEMP_FILE": "/d/r_"}
    assert track.prepare_torch_env("cpu:gloo,cuda:nccl", mine, old) == []
    assert mine["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "0" and track.flight_recorder_dumps(mine) == "/d/r_"
    # The newer name sizes the recorder; the dump's gate reads only the old one there, so it follows the user's size.
    newer = {"TORCH_FR_BUFFER_SIZE": "10"}
    assert track.prepare_torch_env("nccl", newer, old) == ["TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT"]
    assert newer["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "10"
    gloo: dict[str, str] = {"FABRIC_DEBUG_COLLECTIVES": "1"}
    assert track.prepare_torch_env("gloo", gloo, old) == [] and gloo == {"FABRIC_DEBUG_COLLECTIVES": "1"}


@pytest.mark.parametrize("release", [(2, 11, 0), (2, 13, 0)])
def test_nccl_leaves_the_buffer_size_to_torch_where_the_recorder_is_on_by_default(release: tuple) -> None:
    # torch 2.11+ keeps 2000 entries by default and warns that TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated.
    env: dict[str, str] = {}
    assert track.prepare_torch_env("nccl", env, release) == ["TORCH_NCCL_DUMP_ON_TIMEOUT"]
    assert env == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def test_nccl_goes_by_the_running_torchs_release() -> None:
    from fabric.utilities.imports import _TORCH  # 2.13 in the first CI stage, 2.9 in the second

    added = track.prepare_torch_env("nccl", {})
    assert ("TORCH_NCCL_TRACE_BUFFER_SIZE" in added) == (_TORCH < (2, 11, 0)) and "TORCH_NCCL_DUMP_ON_TIMEOUT" in added


def test_no_fabric_recorder_on_nccl_unless_debug_mode_asks(
    one_rank_group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.delenv(track.DEBUG_VARIABLE, raising=False)
    assert track.start_recording() is None
    assert track._recorder(None) is None
    monkeypatch.setenv(track.DEBUG_VARIABLE, "1")  # the cross-rank check goes through the store: it works on NCCL
    assert track.start_recording() is not None

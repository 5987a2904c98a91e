"""`fabric run`'s failure summary names the rank that failed first (unit level; the processes: test_job_ends.py)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from fabric.strategies.launchers._process import (
    FAILURE_DIR_ENV,
    FailureRecord,
    describe_exit,
    read_failure_records,
    read_finished,
    record_finished,
)
from fabric.strategies.launchers.fabric_run import _first_failure, worker_command


def _failure(local_rank: int, exitcode: int, pid: int) -> SimpleNamespace:
    return SimpleNamespace(local_rank=local_rank, exitcode=exitcode, pid=pid)


def test_the_ranks_records_decide_not_the_lowest_rank() -> None:
    failures = {0: _failure(0, 1, 100), 1: _failure(1, 1, 101)}
    line = _first_failure(failures, {0: FailureRecord(12.5, 0, 100), 1: FailureRecord(12.25, 1, 101)})
    assert line == (
        "fabric run: global rank 1 failed first: it exited with code 1 (pid 101); its error is above. "
        "Rank(s) 0 failed after it."
    )


def test_a_rank_that_failed_first_but_was_stopped_while_exiting_is_still_named() -> None:
    # Rank 0 failed after rank 1 but exited sooner; torchrun then stopped rank 1 and reported only rank 0.
    records = {0: FailureRecord(12.5, 0, 100), 1: FailureRecord(12.25, 1, 101)}
    for failures in ({0: _failure(0, 1, 100)}, {0: _failure(0, 1, 100), 1: _failure(1, -15, 101)}):
        assert _first_failure(failures, records) == (
            "fabric run: global rank 1 failed first: it raised an exception (pid 101); its error is above. "
            "Rank(s) 0 failed after it."
        )


def test_records_carry_the_global_rank_and_pid(tmp_path: Path) -> None:
    (tmp_path / "rank1.failed").write_text("12.25 5 4242")
    (tmp_path / "rank2.failed").write_text("half-writ")  # never read as a record
    assert read_failure_records(str(tmp_path)) == {1: FailureRecord(12.25, 5, 4242)}


def test_a_rank_killed_by_a_signal_is_named_when_no_rank_recorded_an_error() -> None:
    failures = {2: _failure(0, 1, 100), 3: _failure(1, -9, 101)}
    assert _first_failure(failures, {}).startswith("fabric run: global rank 3 failed first: it was killed by SIGKILL")


def test_workers_start_through_the_entry_that_ties_them_to_fabric_run() -> None:
    assert worker_command("train.py", ["--lr", "1"]) == [
        "--module",
        "fabric.strategies.launchers._run_worker",
        "train.py",
        "--lr",
        "1",
    ]


def test_a_rank_aborted_while_exiting_is_described_without_an_error_that_is_not_there() -> None:
    # No rank recorded an error; rank 1 aborted in torch's teardown after its script had finished, and torchrun
    # stopped rank 0 (SIGTERM) while it was exiting too.
    failures = {0: _failure(0, -15, 100), 1: _failure(1, -6, 101)}
    assert _first_failure(failures, {}, {101}) == (
        "fabric run: global rank 1 failed first: it was killed by SIGABRT while exiting, after its script had "
        "finished (pid 101); it recorded no Python error. Rank(s) 0 were stopped by torchrun (SIGTERM)."
    )


def test_a_rank_stopped_by_torchrun_is_not_named_before_one_that_exited_with_an_error() -> None:
    failures = {0: _failure(0, -15, 100), 1: _failure(1, 3, 101)}
    assert _first_failure(failures, {}) == (
        "fabric run: global rank 1 failed first: it exited with code 3 (pid 101); it recorded no Python error. "
        "Rank(s) 0 were stopped by torchrun (SIGTERM)."
    )


def test_describe_exit_says_only_what_is_known() -> None:
    assert describe_exit(1, recorded=True, finished=False) == "exited with code 1; its traceback is above"
    assert describe_exit(-9, recorded=False, finished=False) == "was killed by SIGKILL; it recorded no Python error"
    assert describe_exit(2, recorded=False, finished=True) == (
        "exited with code 2 after its script had finished; it recorded no Python error"
    )
    assert describe_exit(-77, recorded=False, finished=False) == "was killed by signal 77; it recorded no Python error"


def test_finished_marks_are_read_by_pid(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv(FAILURE_DIR_ENV, str(tmp_path))
    record_finished()
    (tmp_path / "pidx.finished").write_text("")  # never read as a pid
    assert read_finished(str(tmp_path)) == {os.getpid()}

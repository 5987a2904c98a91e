"""A failing rank ends the whole 2-process job quickly, says which rank failed and why, and leaves no process behind.

Every scenario runs in scripts/fail_*.py under a hard timeout; the ranks write their pids (and the failing rank
the time it failed) so that the test can bound the time from the failure to the end of the job.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import _it_runner as runner
import pytest

from fabric.environments.default import find_free_port

pytestmark = pytest.mark.multiprocess

SCRIPT_MESSAGE = "integration-test-failure-7f3a9c: rank {rank} gave up on purpose"  # fail_ddp_script.py
FUNCTION_MESSAGE = "integration-test-failure-c41e: rank 1 raised on purpose"  # fail_launch_function.py
JOB_TIMEOUT = 60  # hard limit for one scenario, imports included
FAILURE_TO_EXIT = 30  # from the moment a rank fails until the whole job has ended


def _read(path: Path) -> Any:
    return json.loads(path.read_text())


def _pids(outdir: Path) -> list[int]:
    return [_read(outdir / f"rank{rank}.pid.json")["pid"] for rank in (0, 1)]


def _seconds_since_failure(outdir: Path, ended_at: float) -> float:
    return ended_at - _read(outdir / "failed_at.json")["time"]


def _run_ddp_script(outdir: Path, scenario: str) -> runner.ScriptRun:
    run = runner.run_script("fail_ddp_script.py", str(outdir), scenario, timeout=JOB_TIMEOUT, kill_leftovers=False)
    try:
        assert run.returncode != 0, f"the job must fail\n{run.output}"
        assert _seconds_since_failure(outdir, run.finished_at) < FAILURE_TO_EXIT, run.output
        assert not (outdir / "rank0.unexpected.json").exists() and not (outdir / "rank1.unexpected.json").exists()
        assert runner.wait_gone(_pids(outdir), 5.0) == [], f"a rank outlived the job\n{run.output}"
    finally:
        runner.end_group(run.pid)
    return run


def _run_launch_function(outdir: Path, strategy: str, scenario: str) -> dict[str, Any]:
    run = runner.run_script("fail_launch_function.py", str(outdir), strategy, scenario, timeout=JOB_TIMEOUT)
    assert run.returncode == 0, f"the script catches what fabric.launch raises\n{run.output}"
    result = _read(outdir / "result.json")
    assert result["raised"] == "RuntimeError", result
    assert result["returned_at"] - _read(outdir / "failed_at.json")["time"] < FAILURE_TO_EXIT
    assert runner.wait_gone(_pids(outdir), 5.0) == [], "a worker outlived fabric.launch"
    assert "the other processes were ended" in result["message"]
    return result


# -- ddp: the script is re-run for rank 1 --------------------------------------------------------------
def test_ddp_rank1_raises_while_rank0_waits_in_collective(tmp_path: Path) -> None:
    run = _run_ddp_script(tmp_path, "rank1_blocked")
    assert SCRIPT_MESSAGE.format(rank=1) in run.stderr, "rank 1's traceback must reach the user"


def test_ddp_names_rank1_when_it_fails_while_rank0_computes(tmp_path: Path) -> None:
    run = _run_ddp_script(tmp_path, "rank1_busy")
    assert SCRIPT_MESSAGE.format(rank=1) in run.stderr
    assert "The process with global rank 1" in run.stderr and "exited with code 1" in run.stderr, run.stderr


def test_ddp_names_rank1_when_it_fails_while_rank0_waits_in_collective(tmp_path: Path) -> None:
    # Rank 1 takes a few seconds to exit after leaving the process group (its checkpoint plugin flushes at
    # teardown), which makes the race deterministic; without that delay the line is missing too (15 of 15 runs).
    run = _run_ddp_script(tmp_path, "rank1_slow")
    assert SCRIPT_MESSAGE.format(rank=1) in run.stderr
    assert "global rank 1" in run.stderr, run.stderr


@pytest.fixture(scope="module")
def rank0_blocked(tmp_path_factory: pytest.TempPathFactory) -> runner.ScriptRun:
    """One job for both tests of rank 0 failing while rank 1 waits (each job costs two interpreters)."""
    return _run_ddp_script(tmp_path_factory.mktemp("rank0_blocked"), "rank0_blocked")


def test_ddp_rank0_raises_while_rank1_waits_in_collective(rank0_blocked: runner.ScriptRun) -> None:
    # _run_ddp_script also checked that rank 1 was gone within 5 s of the job's end.
    assert SCRIPT_MESSAGE.format(rank=0) in rank0_blocked.stderr


# -- ddp_spawn / ddp_fork: the launched function fails -------------------------------------------------
def test_launch_function_names_root_cause_when_peer_waits_in_collective(tmp_path: Path) -> None:
    result = _run_launch_function(tmp_path, "ddp_fork", "raise_slow")
    assert "global rank 1 raised an exception" in result["message"], result["message"]
    assert FUNCTION_MESSAGE in result["message"]


@pytest.mark.parametrize(
    ("strategy", "scenario", "expected"),
    [
        ("ddp_spawn", "exit3", "global rank 1 exited with code 3"),
        ("ddp_fork", "sigkill", "global rank 1 was killed by SIGKILL"),
    ],
)
def test_launch_function_rank1_dies(tmp_path: Path, strategy: str, scenario: str, expected: str) -> None:
    result = _run_launch_function(tmp_path, strategy, scenario)
    assert expected in result["message"], result["message"]


def test_spawn_raise_in_rank1_names_rank_and_error_and_leaves_no_traceback_file(tmp_path: Path) -> None:
    # torch's spawn wrapper pickles a raising rank's traceback into a world-readable pytorch-errorfile-*.pickle.
    temp, outdir = tmp_path / "tmp", tmp_path / "out"
    temp.mkdir()
    outdir.mkdir()
    script = [sys.executable, str(runner.SCRIPTS / "fail_launch_function.py"), str(outdir), "ddp_spawn", "raise_busy"]
    proc = subprocess.run(script, capture_output=True, text=True, cwd=runner.SCRIPTS, timeout=JOB_TIMEOUT,
                          env={**runner.script_env(), "TMPDIR": str(temp)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = _read(outdir / "result.json")
    assert "global rank 1 raised an exception" in result["message"], result["message"]
    assert FUNCTION_MESSAGE in result["message"]
    assert "ValueError" in result["message"]
    assert not list(temp.glob("pytorch-errorfile-*")), "a rank's traceback file was left behind"


# -- a rank that aborts while exiting, after its work: no error was printed, so none is referred to -----------
def test_ddp_rank_aborted_while_exiting_is_described_as_such(tmp_path: Path) -> None:
    run = runner.run_script("abort_at_exit.py", str(tmp_path), "ddp", timeout=JOB_TIMEOUT)
    assert run.returncode != 0, run.output
    pid = _read(tmp_path / "rank1.finished.json")["pid"]
    assert (
        f"[fabric] The process with global rank 1 (pid {pid}) was killed by SIGABRT while exiting, after its "
        "script had finished; it recorded no Python error. Ending the other processes." in run.stderr
    ), run.output
    assert "traceback is above" not in run.stderr, run.output


def test_spawn_rank_aborted_while_exiting_is_described_as_such(tmp_path: Path) -> None:
    run = runner.run_script("abort_at_exit.py", str(tmp_path), "spawn", timeout=JOB_TIMEOUT)
    assert (
        "fabric.launch(): the process with global rank 1 was killed by SIGABRT while exiting, after its function "
        "had returned (it recorded no Python error); the other processes were ended." in run.stderr
    ), run.output


def test_fabric_run_rank_aborted_while_exiting_is_described_as_such(tmp_path: Path) -> None:
    port = str(find_free_port())
    run = runner.run_python(["-m", "fabric", "run", "--accelerator", "cpu", "--devices", "2", "--main-port", port,
                             "abort_at_exit.py", str(tmp_path), "external"], timeout=JOB_TIMEOUT)  # fmt: skip
    assert run.returncode == 1, run.output
    pid = _read(tmp_path / "rank1.finished.json")["pid"]
    assert (
        "fabric run: global rank 1 failed first: it was killed by SIGABRT while exiting, after its script had "
        f"finished (pid {pid}); it recorded no Python error." in run.stderr
    ), run.output
    assert "its error is above" not in run.stderr, run.output


def test_ddp_does_not_blame_the_rank_that_rank_0s_failure_ended(rank0_blocked: runner.ScriptRun) -> None:
    # Rank 0 raises while rank 1 waits in a collective; rank 1 then ends (on rank 0's abort mark, or its broken
    # collective) after rank 0 failed, and must not be named as the rank whose error rank 0's followed from.
    run = rank0_blocked
    assert SCRIPT_MESSAGE.format(rank=0) in run.stderr
    assert "rank 0's error followed from it" not in run.stderr, run.output
    assert "The process with global rank 1" not in run.stderr, run.output

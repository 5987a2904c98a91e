"""Signals end the whole job quickly and leave no process behind, for every launcher.

The scripts (scripts/sig_*.py) train in a loop of small all_reduces until the test signals a process; each rank
writes its pid first. Every job runs in its own session, which the test ends afterwards whatever happened.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _it_runner as runner
import pytest

pytestmark = pytest.mark.multiprocess

START_TIMEOUT = 45  # both ranks up, imports included (spawn re-imports torch in each worker)
SIGNAL_TO_EXIT = 15  # from the signal until the signalled job has ended
ORPHAN_WAIT = 5  # how long a rank may outlive the main process


class Job:
    """A script started in its own session, and the pids of its two ranks once they are up."""

    def __init__(self, outdir: Path, script: str, *args: str) -> None:
        self.outdir = outdir
        self.proc = subprocess.Popen(
            [sys.executable, str(runner.SCRIPTS / script), str(outdir), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=runner.script_env(),
            cwd=runner.SCRIPTS,
            start_new_session=True,
        )
        self.stdout = self.stderr = ""

    def rank_pids(self) -> list[int]:
        deadline = time.monotonic() + START_TIMEOUT
        files = [self.outdir / f"rank{rank}.pid.json" for rank in (0, 1)]
        while not all(path.exists() for path in files):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.finish(timeout=1)
                pytest.fail(f"the ranks did not start\n{self.output}")
            time.sleep(0.1)
        return [json.loads(path.read_text())["pid"] for path in files]

    def finish(self, timeout: float) -> float:
        """Wait for the main process; the seconds it took."""
        start = time.monotonic()
        try:
            self.stdout, self.stderr = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            runner.end_group(self.proc.pid)
            self.stdout, self.stderr = self.proc.communicate()
            pytest.fail(f"the job did not end within {timeout} s of the signal\n{self.output}")
        return time.monotonic() - start

    @property
    def output(self) -> str:
        return f"--- exit code {self.proc.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


@pytest.fixture
def start(tmp_path: Path) -> Iterator:
    jobs: list[Job] = []

    def _start(script: str, *args: str) -> Job:
        jobs.append(Job(tmp_path, script, *args))
        return jobs[-1]

    yield _start
    for job in jobs:
        runner.end_group(job.proc.pid)
        if job.proc.poll() is None:
            job.proc.kill()
            job.proc.communicate()


def _assert_no_orphans(job: Job, pids: list[int]) -> None:
    alive = runner.wait_gone([pid for pid in pids if pid != job.proc.pid], ORPHAN_WAIT)
    assert alive == [], f"ranks {alive} outlived the job\n{job.output}"


# -- ddp: the script is re-run for rank 1; this process is rank 0 ------------------------------------------------
def test_ddp_child_killed_ends_the_job_and_names_the_rank(start: Any) -> None:
    job = start("sig_ddp.py")
    pids = job.rank_pids()
    os.kill(pids[1], signal.SIGKILL)
    assert job.finish(SIGNAL_TO_EXIT) < SIGNAL_TO_EXIT
    assert job.proc.returncode != 0, job.output
    assert (
        "The process with global rank 1" in job.stderr
        and "was killed by SIGKILL; it recorded no Python error" in job.stderr
    ), job.output
    _assert_no_orphans(job, pids)


def test_ddp_main_process_killed_takes_the_children_with_it(start: Any) -> None:
    job = start("sig_ddp.py")
    pids = job.rank_pids()
    assert pids[0] == job.proc.pid, "rank 0 is the process that ran the script"
    os.kill(job.proc.pid, signal.SIGKILL)
    job.finish(SIGNAL_TO_EXIT)
    assert job.proc.returncode == -signal.SIGKILL
    _assert_no_orphans(job, pids)


def test_ddp_ctrl_c_to_the_main_process_ends_every_child(start: Any) -> None:
    job = start("sig_ddp.py")
    pids = job.rank_pids()
    os.kill(job.proc.pid, signal.SIGINT)  # the main process only, not the whole terminal group
    assert job.finish(SIGNAL_TO_EXIT) < SIGNAL_TO_EXIT
    assert job.proc.returncode != 0, job.output
    assert "KeyboardInterrupt" in job.stderr, job.output
    _assert_no_orphans(job, pids)


# -- ddp_spawn / ddp_fork: the workers run a function; this process waits for them -----------------------------
@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork"])
def test_ctrl_c_to_the_parent_ends_every_worker(start: Any, strategy: str) -> None:
    job = start("sig_spawn.py", strategy)
    pids = job.rank_pids()
    os.kill(job.proc.pid, signal.SIGINT)
    assert job.finish(SIGNAL_TO_EXIT) < SIGNAL_TO_EXIT
    assert job.proc.returncode != 0, job.output
    _assert_no_orphans(job, pids)


def test_parent_killed_takes_the_workers_with_it(start: Any) -> None:
    job = start("sig_spawn.py", "ddp_fork")
    pids = job.rank_pids()
    os.kill(job.proc.pid, signal.SIGKILL)
    job.finish(SIGNAL_TO_EXIT)
    _assert_no_orphans(job, pids)


def test_worker_killed_makes_launch_raise_naming_the_rank(start: Any) -> None:
    job = start("sig_spawn.py", "ddp_fork")
    pids = job.rank_pids()
    killed_at = time.time()
    os.kill(pids[1], signal.SIGKILL)
    job.finish(SIGNAL_TO_EXIT)
    assert job.proc.returncode == 0, f"the script catches what fabric.launch raises\n{job.output}"
    result = json.loads((job.outdir / "result.json").read_text())
    assert result["raised"] == "RuntimeError"
    assert result["message"].startswith(
        "fabric.launch(): the process with global rank 1 was killed by SIGKILL; the other processes were ended."
    ), result
    assert result["time"] - killed_at < SIGNAL_TO_EXIT
    _assert_no_orphans(job, pids)

"""Runs an integration script in its own process group with a hard timeout (used by the test modules, not a script).

The test modules load this file by path, so it works under any pytest import mode.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent
# Variables that would make a script believe it already runs inside a distributed job.
_JOB_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "FABRIC_GLOBAL_SEED",
    "FABRIC_SEED_WORKERS",
    "PL_GLOBAL_SEED",  # seed_everything writes Lightning's names too, and reads them when ours are absent
    "PL_SEED_WORKERS",
)


@dataclass
class ScriptRun:
    """What a finished script left behind."""

    pid: int
    returncode: int
    stdout: str
    stderr: str
    elapsed: float
    finished_at: float  # time.time() when it exited, to compare with times the ranks wrote

    @property
    def output(self) -> str:
        """Both streams, for assertion messages."""
        return f"--- exit code {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


def script_env() -> dict[str, str]:
    """This environment without job variables; one thread per rank (2 ranks share a small CI machine)."""
    env = {k: v for k, v in os.environ.items() if k not in _JOB_VARIABLES and not k.startswith("TORCHELASTIC_")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_python(args: list[str], timeout: float, kill_leftovers: bool = True) -> ScriptRun:
    """`python ARGS` in a new session; on timeout the whole group is ended and the test fails."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=script_env(),
        cwd=SCRIPTS,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_group(proc.pid)
        try:
            stdout, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            stdout, stderr = "", "(streams still held open by a leftover process)"
        pytest.fail(
            f"python {' '.join(args)} did not finish within {timeout} s\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
        )
    run = ScriptRun(proc.pid, proc.returncode, stdout, stderr, time.monotonic() - start, time.time())
    if kill_leftovers:
        end_group(proc.pid)
    return run


def run_script(name: str, *args: str, timeout: float = 60, kill_leftovers: bool = True) -> ScriptRun:
    """Run tests/integration/scripts/NAME with ARGS."""
    return run_python([str(SCRIPTS / name), *args], timeout=timeout, kill_leftovers=kill_leftovers)


def end_group(pgid: int) -> None:
    """End every process left in the group (TERM first, so that torchrun can end its workers)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        if sig == signal.SIGTERM:
            time.sleep(1.0)


def is_alive(pid: int) -> bool:
    """Whether the process exists and is not a zombie (an exited child nobody reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_gone(pids: list[int], seconds: float) -> list[int]:
    """Wait until none of PIDS is alive; return those still alive after SECONDS."""
    deadline = time.monotonic() + seconds
    alive = [pid for pid in pids if is_alive(pid)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in alive if is_alive(pid)]
    return alive

"""How 2-rank jobs end, for every launcher: a killed launcher takes its ranks with it, a hung rank does not
outlive the job, the failure summary names the rank that failed first, and a preemption signal lets the job save
and exit 0, after which a rerun resumes from the saved step.

Every job runs scripts/ends_job.py in a session of its own; each rank writes its pid, and the test checks by pid
that no process of the job outlives it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _it_runner as runner
import pytest

from fabric.environments.default import find_free_port

pytestmark = pytest.mark.multiprocess

START_TIMEOUT = 60  # both ranks up and in the loop, imports included, on a loaded 2-core machine
TIMEOUT_SECONDS = 3  # ends_job.py's DDPStrategy(timeout=...)
BOUND_SECONDS = TIMEOUT_SECONDS + 30  # the bound: collective timeout + 30 s
ORPHAN_WAIT = 5
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2",
         "SLURM_NNODES": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURM_NODELIST": "127.0.0.1",
         "SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_JOB_NAME": "train"}  # fmt: skip


class Job:
    """ends_job.py started by one launcher, each top-level process in a session of its own."""

    def __init__(self, outdir: Path, start: str, scenario: str, *args: str) -> None:
        self.outdir = outdir
        script = [str(runner.SCRIPTS / "ends_job.py"), str(outdir)]
        port = str(find_free_port())
        if start in ("ddp", "spawn"):
            commands = [([sys.executable, *script, start, scenario, *args], {})]
        elif start == "fabric_run":
            run = ["-m", "fabric", "run", "--accelerator", "cpu", "--devices", "2", "--main-port", port]
            commands = [([sys.executable, *run, *script, "external", scenario, *args], {})]
        elif start == "torchrun":
            run = ["-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"]
            commands = [([sys.executable, *run, *script, "external", scenario, *args], {})]
        else:  # srun: one task per rank, as srun starts them (and, by default, waits for both)
            task = [sys.executable, *script, "external", scenario, *args]
            commands = [(task, {**SLURM, "MASTER_PORT": port, "SLURM_PROCID": r, "SLURM_LOCALID": r}) for r in "01"]
        self.procs = [
            subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**runner.script_env(), **extra},
                cwd=runner.SCRIPTS,
                start_new_session=True,
            )
            for command, extra in commands
        ]
        self.stdout = self.stderr = ""

    @property
    def main(self) -> subprocess.Popen:
        return self.procs[0]

    def wait_for(self, name: str) -> None:
        """Until both ranks wrote rank{N}.NAME.json."""
        deadline = time.monotonic() + START_TIMEOUT
        while not all((self.outdir / f"rank{rank}.{name}.json").exists() for rank in (0, 1)):
            if any(proc.poll() is not None for proc in self.procs) or time.monotonic() > deadline:
                self.finish(1)
                pytest.fail(f"the ranks did not write {name}\n{self.output}")
            time.sleep(0.1)

    def pids(self) -> list[int]:
        return [read(self.outdir / f"rank{rank}.pid.json")["pid"] for rank in (0, 1)]

    def finish(self, timeout: float) -> list[int]:
        """Wait for the job's top-level processes; their exit codes."""
        deadline = time.monotonic() + timeout
        outputs = []
        for proc in self.procs:
            try:
                outputs.append(proc.communicate(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                for other in self.procs:
                    runner.end_group(other.pid)
                outputs.append(proc.communicate())
        self.stdout = "".join(out for out, _ in outputs)
        self.stderr = "".join(err for _, err in outputs)
        return [proc.returncode for proc in self.procs]

    def end(self) -> None:
        for proc in self.procs:
            runner.end_group(proc.pid)
            if proc.poll() is None:
                proc.kill()
                proc.communicate()

    @property
    def output(self) -> str:
        codes = [proc.returncode for proc in self.procs]
        return f"--- exit codes {codes}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"

    def assert_no_process_left(self) -> None:
        alive = runner.wait_gone(self.pids(), ORPHAN_WAIT)
        assert alive == [], f"ranks {alive} outlived the job\n{self.output}"


def read(path: Path) -> Any:
    return json.loads(path.read_text())


@pytest.fixture
def job(tmp_path: Path) -> Iterator:
    jobs: list[Job] = []

    def start(launcher: str, scenario: str, *args: str) -> Job:
        jobs.append(Job(tmp_path, launcher, scenario, *args))
        return jobs[-1]

    yield start
    for started in jobs:
        started.end()


# -- a killed launcher ------------------------------------------------------------------------------------
@pytest.mark.parametrize("launcher", ["fabric_run", "torchrun"])
def test_sigkill_of_the_launcher_takes_the_ranks_with_it(job: Any, launcher: str) -> None:
    started = job(launcher, "train")
    started.wait_for("pid")
    os.kill(started.main.pid, signal.SIGKILL)
    started.finish(10)
    assert started.main.returncode == -signal.SIGKILL
    started.assert_no_process_left()
    assert not list(started.outdir.glob("*.unexpected.json"))


# -- a rank stuck in its own code while its peer times out ------------------------------------------------
@pytest.mark.parametrize("launcher", ["srun", "ddp", "spawn", "fabric_run", "torchrun"])
def test_a_hung_rank_ends_with_the_job(job: Any, launcher: str) -> None:
    started = job(launcher, "hang0")
    started.wait_for("pid")
    up_at = max(read(started.outdir / f"rank{rank}.pid.json")["time"] for rank in (0, 1))
    codes = started.finish(BOUND_SECONDS + 15)
    assert time.time() - up_at < BOUND_SECONDS, started.output
    assert any(code != 0 for code in codes), started.output
    # The waiting rank's message (tests/integration/test_hang_diagnosis.py) names the hung rank, not itself.
    waiting = r"fabric\.all_reduce\(\) at ends_job\.py:\d+ \(collective #\d+\) timed out after 0:00:03: rank 0 has not"
    assert re.search(waiting, started.stderr), started.output
    started.assert_no_process_left()
    if launcher == "srun":  # nothing but fabric ends rank 0 there
        assert "[fabric] Global rank 1 failed (its error is in its output), so global rank 0 ends too" in (
            started.stderr
        ), started.output


@pytest.mark.parametrize("launcher", ["ddp", "spawn", "fabric_run", "torchrun"])
def test_a_rank_killed_outright_ends_the_job_while_the_other_is_in_its_own_code(job: Any, launcher: str) -> None:
    # SIGKILL leaves no abort mark and rank 0 is in no collective: the launcher or agent sees its child die.
    started = job(launcher, "sleep")
    started.wait_for("pid")
    os.kill(started.pids()[1], signal.SIGKILL)
    killed_at = time.time()
    codes = started.finish(BOUND_SECONDS + 15)
    assert time.time() - killed_at < BOUND_SECONDS, started.output
    assert any(code != 0 for code in codes), started.output
    started.assert_no_process_left()
    assert not list(started.outdir.glob("*.unexpected.json"))


def test_under_srun_a_rank_killed_outright_ends_its_peer_at_its_next_collective(job: Any) -> None:
    # Nothing of fabric ends a rank that is not waiting for the killed one: a rank killed outright left no evidence
    # but silence, and a silent peer is no reason to end a rank in its own code (srun --kill-on-bad-exit ends the
    # job step at once). Rank 0's next collective fails, and says what it saw.
    started = job("srun", "sleep_reduce")
    started.wait_for("pid")
    os.kill(started.pids()[1], signal.SIGKILL)
    killed_at = time.time()
    codes = started.finish(BOUND_SECONDS + 15)
    assert time.time() - killed_at < BOUND_SECONDS, started.output
    assert codes == [1, -signal.SIGKILL], started.output
    assert re.search(
        r"rank 1 has not arrived; .* gave no sign of life for \d+ s as seen from this rank", started.stderr
    ), started.output
    assert "[fabric] Global rank" not in started.stderr, "no abort mark: rank 1 recorded no failure"
    started.assert_no_process_left()
    assert not list(started.outdir.glob("*.unexpected.json"))


def test_fabric_run_names_the_rank_that_failed_first(job: Any) -> None:
    # Rank 0 fails too (its all_reduce loses its peer) within the same second; torchrun's own report named it.
    started = job("fabric_run", "raise1")
    codes = started.finish(START_TIMEOUT)
    assert codes == [1], started.output
    assert "integration-test-failure-e2d7: rank 1 raised on purpose" in started.stderr
    # "raised an exception": rank 0 failed after rank 1 but exited sooner, and torchrun stopped rank 1 while it exited.
    first = (
        r"fabric run: a process failed\.\nfabric run: global rank 1 failed first: "
        r"it (exited with code 1|raised an exception) \(pid "
    )
    assert re.search(first, started.stderr), started.output
    # Rank 0 is named after it only when it failed before torchrun stopped it: not asserted.
    started.assert_no_process_left()


# -- preemption ----------------------------------------------------------------------------------------
def _signal(started: Job, to: str) -> None:
    pids = started.pids() if to == "ranks" else [started.main.pid]
    for pid in pids:  # srun and SLURM's --signal deliver it to every task at once
        os.kill(pid, signal.SIGTERM)


@pytest.mark.parametrize(
    ("launcher", "to"), [("ddp", "launcher"), ("spawn", "launcher"), ("fabric_run", "launcher"), ("srun", "ranks")]
)
def test_sigterm_mid_training_saves_and_exits_zero(job: Any, launcher: str, to: str) -> None:
    started = job(launcher, "preempt", "100000")
    started.wait_for("trained")  # 3 steps done
    _signal(started, to)
    codes = started.finish(START_TIMEOUT)
    assert all(code == 0 for code in codes), started.output
    saved = [read(started.outdir / f"rank{rank}.preempted.json")["step"] for rank in (0, 1)]
    assert saved[0] == saved[1] >= 3, "both ranks stop and save at the same step"
    assert (started.outdir / "ckpt.pt").exists()
    assert not list(started.outdir.glob("*.finished.json"))
    started.assert_no_process_left()
    if launcher == "ddp":  # the rerun resumes from the saved step and finishes
        resumed = job("ddp", "preempt", str(saved[0] + 3))
        assert resumed.finish(START_TIMEOUT) == [0], resumed.output
        for rank in (0, 1):
            assert read(started.outdir / f"rank{rank}.start.json")["step"] == saved[0]
            assert read(started.outdir / f"rank{rank}.finished.json")["step"] == saved[0] + 3


def test_sigterm_still_ends_a_job_that_never_checks_preemption(job: Any) -> None:
    started = job("ddp", "train")
    started.wait_for("pid")
    os.kill(started.main.pid, signal.SIGTERM)
    assert started.finish(15) == [-signal.SIGTERM], started.output
    started.assert_no_process_left()

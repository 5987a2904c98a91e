"""Never end a healthy job on a guess: real 2-rank gloo jobs started by hand, as srun starts them (nothing but
fabric could end a rank there), each rank in a session of its own.

- A rank in a PID namespace of its own (a container with the host's network): its pid means nothing to the other
  rank, and nothing ends either of them.
- A rank that finished and left with os._exit(0) is no reason to end the rank that works on without it.
- Each rank runs exactly one fabric thread.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import _it_runner as runner
import pytest

from fabric.environments.default import find_free_port

pytestmark = pytest.mark.multiprocess

SCRIPT = runner.SCRIPTS / "health_job.py"
JOB_TIMEOUT = 120  # two ranks on a loaded 2-core machine, imports included
# srun's variables for one node with two tasks: fabric takes them as SLURM, which supervises nothing itself.
SLURM = {"SLURM_JOB_ID": "4243", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2",
         "SLURM_NNODES": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURM_NODELIST": "127.0.0.1",
         "SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_JOB_NAME": "train"}  # fmt: skip


def _unshare_permitted() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "--pid", "--fork", "--mount-proc", "true"]
    return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0


def _run(tmp_path: Path, case: str, namespaced: int | None = None) -> list[tuple[int | None, str]]:
    """Start both ranks (rank `namespaced` in its own PID namespace); their exit codes and output."""
    common = {**runner.script_env(), **SLURM, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port())}
    procs, logs = [], []
    for rank in range(2):
        env = {**common, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)}
        command = [sys.executable, str(SCRIPT), str(tmp_path), case]
        if rank == namespaced:
            command = ["unshare", "--pid", "--fork", "--mount-proc", *command]
        logs.append((tmp_path / f"rank{rank}.log").open("w"))
        procs.append(
            subprocess.Popen(
                command, env=env, stdout=logs[-1], stderr=subprocess.STDOUT, cwd=runner.SCRIPTS, start_new_session=True
            )
        )
    try:
        for proc in procs:
            try:
                proc.wait(timeout=JOB_TIMEOUT)
            except subprocess.TimeoutExpired:
                break
    finally:
        codes = [proc.poll() for proc in procs]
        for proc in procs:
            runner.end_group(proc.pid)
            proc.wait(timeout=10)
        for log in logs:
            log.close()
    return [(code, (tmp_path / f"rank{rank}.log").read_text()) for rank, code in enumerate(codes)]


def _finished(tmp_path: Path, rank: int) -> bool:
    return (tmp_path / f"rank{rank}.finished.json").exists()


@pytest.mark.parametrize("namespaced", [0, 1])
def test_a_rank_in_its_own_pid_namespace_trains_to_the_end(tmp_path: Path, namespaced: int) -> None:
    if not _unshare_permitted():
        pytest.skip("unshare --pid --fork --mount-proc is not permitted here (it needs root or user namespaces)")
    ranks = _run(tmp_path, "train", namespaced)
    for rank, (code, output) in enumerate(ranks):
        assert code == 0, f"rank {rank}:\n{output}"
        assert _finished(tmp_path, rank), output
        assert "[fabric]" not in output, output


@pytest.fixture(scope="module")
def early_exit(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[int | None, str]]]:
    """One early_exit job for both tests below (each job costs two interpreters that import torch's compiler):
    its folder, and each rank's exit code and output."""
    outdir = tmp_path_factory.mktemp("early_exit")
    return outdir, _run(outdir, "early_exit")


def test_a_peer_that_left_with_os_exit_does_not_end_the_rank_that_works_on(
    early_exit: tuple[Path, list[tuple[int | None, str]]],
) -> None:
    outdir, ranks = early_exit
    assert ranks[1][0] == 0, ranks[1][1]
    assert ranks[0][0] == 0, f"rank 0 must finish its own work:\n{ranks[0][1]}"
    assert _finished(outdir, 0), ranks[0][1]
    assert "killed or crashed" not in ranks[0][1], ranks[0][1]


def test_each_rank_runs_exactly_one_fabric_thread(early_exit: tuple[Path, list[tuple[int | None, str]]]) -> None:
    # Both ranks of the early_exit job trained as in `train` before either left, and named their threads after
    # setup, while both were up.
    outdir, ranks = early_exit
    assert [code for code, _ in ranks] == [0, 0], ranks
    for rank in range(2):
        names = json.loads((outdir / f"rank{rank}.threads.json").read_text())
        assert [name for name in names if "fabric" in name] == ["fabric-health"], names

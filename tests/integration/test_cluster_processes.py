"""Real processes started the way SLURM's srun and a Kubeflow PyTorchJob start them form one job."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fabric.environments.default import find_free_port

SCRIPT = Path(__file__).parent / "scripts" / "cluster_report.py"
_SCHEDULER_PREFIXES = ("SLURM_", "LSB_", "JSM_", "OMPI_", "PMI_", "KUBERNETES_")
_TORCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE",
               "TORCHELASTIC_RUN_ID", "NODE_RANK")  # fmt: skip


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(_SCHEDULER_PREFIXES) and k not in _TORCH_VARS}


def _run_ranks(tmp_path: Path, envs: list[dict[str, str]], devices: int, num_nodes: int) -> list[dict]:
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(tmp_path), str(devices), str(num_nodes)],
            env={**_clean_env(), **env},
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for env in envs
    ]
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(len(envs))]


@pytest.mark.multiprocess
def test_two_srun_tasks_form_one_job(tmp_path: Path) -> None:
    common = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2",
              "SLURM_NNODES": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURM_NODELIST": "127.0.0.1",
              "SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_JOB_NAME": "train",
              "MASTER_PORT": str(find_free_port())}  # fmt: skip
    envs = [{**common, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)} for r in range(2)]
    reports = _run_ranks(tmp_path, envs, devices=2, num_nodes=1)
    for rank, report in enumerate(reports):
        assert report == {"environment": "SLURMEnvironment", "launcher": True, "rank": rank, "local_rank": rank,
                          "node_rank": 0, "world_size": 2, "sum": 1.0}  # fmt: skip


@pytest.mark.multiprocess
def test_two_kubeflow_pods_form_one_job(tmp_path: Path) -> None:
    common = {"KUBERNETES_PORT": "tcp://10.0.0.1:443", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(find_free_port()), "WORLD_SIZE": "2"}  # fmt: skip
    envs = [{**common, "RANK": str(r)} for r in range(2)]
    reports = _run_ranks(tmp_path, envs, devices=1, num_nodes=2)
    for rank, report in enumerate(reports):
        assert report == {"environment": "KubeflowEnvironment", "launcher": True, "rank": rank, "local_rank": 0,
                          "node_rank": rank, "world_size": 2, "sum": 1.0}  # fmt: skip


@pytest.mark.multiprocess
def test_two_jsrun_tasks_form_one_lsf_job(tmp_path: Path) -> None:
    host = socket.gethostname()
    common = {"LSB_JOBID": "77", "LSB_MCPU_HOSTS": f"batch1 1 {host} 2", "JSM_NAMESPACE_SIZE": "2",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port())}  # fmt: skip
    envs = [{**common, "JSM_NAMESPACE_RANK": str(r), "JSM_NAMESPACE_LOCAL_RANK": str(r)} for r in range(2)]
    reports = _run_ranks(tmp_path, envs, devices=2, num_nodes=1)
    for rank, report in enumerate(reports):
        assert report == {"environment": "LSFEnvironment", "launcher": True, "rank": rank, "local_rank": rank,
                          "node_rank": 0, "world_size": 2, "sum": 1.0}  # fmt: skip


@pytest.mark.multiprocess
def test_two_mpirun_ranks_form_one_mpi_job(tmp_path: Path) -> None:
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install torchfabric[mpi])")
    mpirun = Path(sys.executable).parent / "mpirun"
    if not mpirun.exists():
        pytest.skip("no mpirun next to this interpreter (pip install torchfabric[mpi] brings MPICH's)")
    proc = subprocess.run(
        [str(mpirun), "-n", "2", sys.executable, str(SCRIPT), str(tmp_path), "2", "1"],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report == {"environment": "MPIEnvironment", "launcher": True, "rank": rank, "local_rank": rank,
                          "node_rank": 0, "world_size": 2, "sum": 1.0}  # fmt: skip

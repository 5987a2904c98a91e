"""detect_environment(): which environment wins when several schedulers' variables are present."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from fabric import Fabric
from fabric.environments import (
    DETECTION_ORDER,
    DefaultEnvironment,
    KubeflowEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
    detect_environment,
)

pytestmark = pytest.mark.usefixtures("no_cluster_env")

SRUN = {
    "SLURM_JOB_ID": "991",
    "SLURM_NODELIST": "n[01-02]",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "2",
    "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
}
# what torchrun adds in each worker it starts
TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "991",
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "GROUP_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "n01",
    "MASTER_PORT": "29500",
}


@pytest.fixture(autouse=True)
def _no_mpi4py_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "mpi4py", raising=False)


def _set(monkeypatch: pytest.MonkeyPatch, values: dict[str, str]) -> None:
    for name, value in values.items():
        monkeypatch.setenv(name, value)


def test_detection_order() -> None:
    # another environment may be put in front; the relative order of these is the documented one
    expected = (
        SLURMEnvironment,
        TorchElasticEnvironment,
        KubeflowEnvironment,
        LSFEnvironment,
        MPIEnvironment,
        DefaultEnvironment,
    )
    assert DETECTION_ORDER[-len(expected) :] == expected


def test_nothing_set_is_default() -> None:
    assert type(detect_environment()) is DefaultEnvironment


def test_srun_task_is_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, SRUN)
    env = detect_environment()
    assert type(env) is SLURMEnvironment
    assert env.global_rank() == 1


def test_torchrun_launched_by_srun_is_torchelastic(monkeypatch: pytest.MonkeyPatch) -> None:
    # `srun --ntasks-per-node=1 torchrun --nproc_per_node=4 train.py`: the workers carry both sets of variables
    _set(monkeypatch, {**SRUN, **TORCHRUN})
    env = detect_environment()
    assert type(env) is TorchElasticEnvironment
    assert (env.global_rank(), env.local_rank(), env.node_rank(), env.world_size()) == (5, 1, 1, 8)


def test_torchrun_in_sbatch_script_is_torchelastic(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}
    _set(monkeypatch, {**batch, **TORCHRUN})
    assert type(detect_environment()) is TorchElasticEnvironment


def test_python_in_sbatch_script_is_default(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}
    _set(monkeypatch, {**batch, "SLURM_PROCID": "0", "SLURM_NODEID": "0"})
    env = detect_environment()
    assert type(env) is DefaultEnvironment
    assert not env.creates_processes_externally  # fabric starts the processes itself
    # and fabric's own children (they get LOCAL_RANK, WORLD_SIZE, MASTER_*, not RANK) stay on the default
    _set(monkeypatch, {"LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"})
    env = detect_environment()
    assert type(env) is DefaultEnvironment
    assert env.local_rank() == 1


def test_kubeflow_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    pod = {"KUBERNETES_PORT": "tcp://10.96.0.1:443", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    _set(monkeypatch, {**pod, "WORLD_SIZE": "2", "RANK": "1"})
    assert type(detect_environment()) is KubeflowEnvironment
    # torchrun inside the pod: its workers are TorchElastic's
    _set(monkeypatch, {**pod, **TORCHRUN})
    assert type(detect_environment()) is TorchElasticEnvironment


def test_jsrun_is_lsf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _set(monkeypatch, {"LSB_JOBID": "7", "JSM_NAMESPACE_RANK": "0", "JSM_NAMESPACE_SIZE": "2"})
    assert type(detect_environment()) is DefaultEnvironment  # JSM_NAMESPACE_LOCAL_RANK missing: not jsrun
    monkeypatch.setenv("JSM_NAMESPACE_LOCAL_RANK", "0")
    assert type(detect_environment()) is LSFEnvironment


def test_mpirun_with_mpi4py_is_mpi(monkeypatch: pytest.MonkeyPatch) -> None:
    # a minimal fake mpi4py for one process of a 2-process job on one node (see test_mpi.py)
    class Comm:
        def __init__(self, rank: int, size: int) -> None:
            self.rank, self.size = rank, size

        def Get_rank(self) -> int:
            return self.rank

        def Get_size(self) -> int:
            return self.size

        def bcast(self, obj: object, root: int = 0) -> object:
            return obj

        def allgather(self, obj: object) -> list[object]:
            return [obj, None]

        def Split_type(self, kind: int) -> Comm:
            return Comm(0, 2)

    mpi = types.ModuleType("mpi4py.MPI")
    mpi.COMM_WORLD = Comm(0, 2)  # type: ignore[attr-defined]
    mpi.COMM_TYPE_SHARED = 1  # type: ignore[attr-defined]
    package = types.ModuleType("mpi4py")
    package.MPI = mpi  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mpi4py", package)
    assert type(detect_environment()) is DefaultEnvironment  # no mpirun variables: MPI is not initialised
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    env = detect_environment()
    assert type(env) is MPIEnvironment
    assert env.world_size() == 2


def test_srun_wins_over_mpi_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    # srun --mpi=pmi2 also sets PMI_SIZE; SLURM is checked first, so mpi4py is never needed
    _set(monkeypatch, {**SRUN, "PMI_SIZE": "2", "PMI_RANK": "1"})
    assert type(detect_environment()) is SLURMEnvironment


def test_fabric_uses_torchelastic_for_torchrun_under_srun(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, {**SRUN, **TORCHRUN})
    fabric = Fabric(accelerator="cpu", devices="auto", num_nodes=2)
    assert isinstance(fabric.strategy.cluster_environment, TorchElasticEnvironment)
    assert (fabric.global_rank, fabric.world_size) == (5, 8)
    assert fabric.strategy.launcher is None

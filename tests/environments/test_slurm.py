"""SLURMEnvironment: the variables srun sets in each task, host list expansion, detection and validation."""

from __future__ import annotations

import signal

import pytest

from fabric import Fabric
from fabric.environments import SLURMEnvironment
from fabric.environments.slurm import expand_hostlist, expand_tasks_per_node

pytestmark = pytest.mark.usefixtures("no_cluster_env")

# Task 3 of `sbatch --nodes=2 --ntasks-per-node=2` + `srun python train.py`, as srun sets it (SLURM 23.x).
SRUN_TASK_3 = {
    "SLURM_JOB_ID": "4817234",
    "SLURM_JOBID": "4817234",
    "SLURM_JOB_NAME": "train.sh",
    "SLURM_JOB_NODELIST": "gpu-[017-018]",
    "SLURM_NODELIST": "gpu-[017-018]",
    "SLURM_STEP_NODELIST": "gpu-[017-018]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_NTASKS": "4",
    "SLURM_NPROCS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURMD_NODENAME": "gpu-018",
}


def _set(monkeypatch: pytest.MonkeyPatch, values: dict[str, str]) -> None:
    for name, value in values.items():
        monkeypatch.setenv(name, value)


# -- host list ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("hostlist", "expected"),
    [
        ("node001", ["node001"]),
        ("node[001-004,007]", ["node001", "node002", "node003", "node004", "node007"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        ("gpu-[1-2]", ["gpu-1", "gpu-2"]),
        ("gpu-[8-10]", ["gpu-8", "gpu-9", "gpu-10"]),
        ("n[1-2],m[05,07]", ["n1", "n2", "m05", "m07"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("host.example.com,other", ["host.example.com", "other"]),
    ],
)
def test_expand_hostlist(hostlist: str, expected: list[str]) -> None:
    assert expand_hostlist(hostlist) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [("4", [4]), ("2(x3)", [2, 2, 2]), ("2(x3),1", [2, 2, 2, 1]), ("3,1(x2)", [3, 1, 1])],
)
def test_expand_tasks_per_node(value: str, expected: list[int]) -> None:
    assert expand_tasks_per_node(value) == expected


def test_expand_tasks_per_node_rejects_garbage() -> None:
    with pytest.raises(ValueError, match=r"cannot read the task count 'x' in '2,x'"):
        expand_tasks_per_node("2,x")


# -- detection ---------------------------------------------------------------------------------------------
def test_detects_srun_task(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not SLURMEnvironment.detect()
    _set(monkeypatch, SRUN_TASK_3)
    assert SLURMEnvironment.detect()


def test_not_detected_in_batch_script_without_srun(monkeypatch: pytest.MonkeyPatch) -> None:
    # `python train.py` directly in the sbatch script: the batch step sets SLURM_PROCID=0 etc. but no step id
    batch = {k: v for k, v in SRUN_TASK_3.items() if k not in ("SLURM_STEP_ID", "SLURM_STEPID")}
    _set(monkeypatch, {**batch, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"})
    assert not SLURMEnvironment.detect()
    # newer SLURM versions may name the batch step by its special id (0xfffffffb): still not srun
    monkeypatch.setenv("SLURM_STEP_ID", "4294967291")
    assert not SLURMEnvironment.detect()


def test_not_detected_in_salloc_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    # salloc's shell on the login node: allocation variables only, no task variables
    _set(monkeypatch, {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2", "SLURM_NTASKS": "8"})
    assert not SLURMEnvironment.detect()
    # salloc with LaunchParameters=use_interactive_step: the shell is the interactive step (0xfffffffa)
    _set(monkeypatch, {"SLURM_STEP_ID": "4294967290", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"})
    assert not SLURMEnvironment.detect()


def test_not_detected_in_srun_pty_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, {**SRUN_TASK_3, "SLURM_PTY_PORT": "41235", "SLURM_JOB_NAME": "bash"})
    assert not SLURMEnvironment.detect()


def test_srun_inside_salloc_named_bash_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    # Lightning's job-name heuristic would miss this: `salloc` (job name "bash") then `srun python train.py`
    _set(monkeypatch, {**SRUN_TASK_3, "SLURM_JOB_NAME": "bash"})
    assert SLURMEnvironment.detect()


@pytest.mark.parametrize(
    "torchrun",
    [
        {"TORCHELASTIC_RUN_ID": "none", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"},
        {"GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "2", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"},
    ],
)
def test_not_detected_for_torchrun_inside_srun(monkeypatch: pytest.MonkeyPatch, torchrun: dict[str, str]) -> None:
    _set(monkeypatch, {**SRUN_TASK_3, **torchrun})
    assert not SLURMEnvironment.detect()


@pytest.mark.parametrize("missing", ["SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"])
def test_not_detected_without_task_variables(monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    _set(monkeypatch, SRUN_TASK_3)
    monkeypatch.delenv(missing)
    assert not SLURMEnvironment.detect()


# -- values ------------------------------------------------------------------------------------------------
def test_values(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, SRUN_TASK_3)
    env = SLURMEnvironment()
    assert env.creates_processes_externally
    assert env.world_size() == 4
    assert env.global_rank() == 3
    assert env.local_rank() == 1
    assert env.node_rank() == 1
    assert env.processes_per_node() == 2
    assert env.main_address == "gpu-017"
    assert env.main_port == 15000 + 7234


def test_main_address_and_port_overridable(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, {**SRUN_TASK_3, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29400"})
    env = SLURMEnvironment()
    assert env.main_address == "10.0.0.5"
    assert env.main_port == 29400


def test_main_address_falls_back_to_job_nodelist(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, SRUN_TASK_3)
    monkeypatch.delenv("SLURM_STEP_NODELIST")
    monkeypatch.delenv("SLURM_NODELIST")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "a1,b[2-3]")
    assert SLURMEnvironment().main_address == "a1"


def test_port_is_the_same_for_every_task(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, SRUN_TASK_3)
    ports = set()
    for rank in range(4):
        monkeypatch.setenv("SLURM_PROCID", str(rank))
        ports.add(SLURMEnvironment().main_port)
    assert ports == {22234}


@pytest.mark.parametrize(
    ("drop", "extra", "expected"),
    [
        (("SLURM_NTASKS_PER_NODE",), {}, 2),  # from SLURM_STEP_TASKS_PER_NODE "2(x2)"
        (("SLURM_NTASKS_PER_NODE",), {"SLURM_STEP_TASKS_PER_NODE": "3,1"}, 1),  # uneven: this node (1) has 1
        (("SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"), {}, 2),  # 4 tasks / 2
        ((), {"SLURM_NTASKS_PER_NODE": "2(x3)"}, 2),
    ],
)
def test_processes_per_node_sources(
    monkeypatch: pytest.MonkeyPatch, drop: tuple[str, ...], extra: dict[str, str], expected: int
) -> None:
    _set(monkeypatch, {**SRUN_TASK_3, **extra})
    for name in drop:
        monkeypatch.delenv(name, raising=False)
    assert SLURMEnvironment().processes_per_node() == expected


def test_requeue_settings_are_stored() -> None:
    assert SLURMEnvironment().auto_requeue is True
    assert SLURMEnvironment().requeue_signal == getattr(signal, "SIGUSR1", None)
    env = SLURMEnvironment(auto_requeue=False, requeue_signal=signal.SIGTERM)
    assert env.auto_requeue is False
    assert env.requeue_signal == signal.SIGTERM


# -- validation --------------------------------------------------------------------------------------------
def test_validate_settings_accepts_matching_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, SRUN_TASK_3)
    SLURMEnvironment().validate_settings(num_devices=2, num_nodes=2)  # no error


def test_validate_settings_devices_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, SRUN_TASK_3)
    with pytest.raises(
        ValueError, match=r"Fabric\(devices=4\): srun started 2 tasks on this node \(SLURM_NTASKS_PER_NODE=2\)\. Pass"
    ):
        SLURMEnvironment().validate_settings(num_devices=4, num_nodes=2)


def test_validate_settings_devices_mismatch_names_derived_source(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, SRUN_TASK_3)
    for name in ("SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        monkeypatch.delenv(name)
    with pytest.raises(
        ValueError, match=r"srun started 2 tasks on this node \(SLURM_NTASKS / SLURM_STEP_NUM_NODES=4/2\)"
    ):
        SLURMEnvironment().validate_settings(num_devices=1, num_nodes=2)


def test_validate_settings_nodes_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, SRUN_TASK_3)
    with pytest.raises(ValueError, match=r"Fabric\(num_nodes=4\): srun runs on 2 nodes \(SLURM_STEP_NUM_NODES=2\)"):
        SLURMEnvironment().validate_settings(num_devices=2, num_nodes=4)
    monkeypatch.delenv("SLURM_STEP_NUM_NODES")
    monkeypatch.delenv("SLURM_NNODES")
    with pytest.raises(ValueError, match=r"\(SLURM_JOB_NUM_NODES=2\)\. Pass num_nodes=2"):
        SLURMEnvironment().validate_settings(num_devices=2, num_nodes=1)


# -- through the connector ---------------------------------------------------------------------------------
def test_fabric_under_srun_takes_ranks_from_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, SRUN_TASK_3)
    fabric = Fabric(accelerator="cpu", devices=2, num_nodes=2)
    assert isinstance(fabric.strategy.cluster_environment, SLURMEnvironment)
    assert fabric.global_rank == 3
    assert fabric.local_rank == 1
    assert fabric.node_rank == 1
    assert fabric.world_size == 4
    assert fabric.strategy.launcher is None


def test_fabric_devices_auto_under_srun(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, SRUN_TASK_3)
    fabric = Fabric(accelerator="cpu", devices="auto", num_nodes=2)
    assert fabric.world_size == 4
    assert fabric.local_rank == 1


def test_fabric_devices_mismatch_under_srun(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, SRUN_TASK_3)
    with pytest.raises(ValueError, match=r"Fabric\(devices=4\).*SLURM_NTASKS_PER_NODE=2"):
        Fabric(accelerator="cpu", devices=4, num_nodes=2)


def test_fabric_in_batch_script_without_srun_uses_own_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = {k: v for k, v in SRUN_TASK_3.items() if k not in ("SLURM_STEP_ID", "SLURM_STEPID")}
    _set(monkeypatch, {**batch, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"})
    fabric = Fabric(accelerator="cpu", devices=2)
    assert not isinstance(fabric.strategy.cluster_environment, SLURMEnvironment)
    assert fabric.strategy.launcher is not None


def test_plugin_forces_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    # detection would say no (no step id), but the user chose SLURM explicitly
    batch = {k: v for k, v in SRUN_TASK_3.items() if k not in ("SLURM_STEP_ID", "SLURM_STEPID")}
    _set(monkeypatch, batch)
    assert not SLURMEnvironment.detect()
    fabric = Fabric(accelerator="cpu", devices=2, num_nodes=2, plugins=[SLURMEnvironment()])
    assert isinstance(fabric.strategy.cluster_environment, SLURMEnvironment)
    assert fabric.global_rank == 3
    assert fabric.strategy.launcher is None

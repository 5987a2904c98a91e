"""LSFEnvironment: jsrun's JSM_NAMESPACE_* variables and the LSF host lists (rank file, LSB_MCPU_HOSTS, LSB_HOSTS)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fabric import Fabric
from fabric.environments import LSFEnvironment
from fabric.environments import lsf as lsf_module

pytestmark = pytest.mark.usefixtures("no_cluster_env")

# `bsub -nnodes 2` + `jsrun -n 2 -a 4 -g 4 python train.py`: rank 5 runs on the second compute host.
JSRUN_RANK_5 = {
    "LSB_JOBID": "318254",
    "JSM_NAMESPACE_RANK": "5",
    "JSM_NAMESPACE_SIZE": "8",
    "JSM_NAMESPACE_LOCAL_RANK": "1",
    "LSB_MCPU_HOSTS": "batch3 1 h41n01 42 h41n02 42",
}


@pytest.fixture
def jsrun(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    # the rank file lists one host per slot; its first line is the launch (batch) node
    rankfile = tmp_path / "rankfile"
    rankfile.write_text("batch3\n" + "h41n01\n" * 42 + "h41n02\n" * 42)
    for name, value in {**JSRUN_RANK_5, "LSB_DJOB_RANKFILE": str(rankfile)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(lsf_module.socket, "gethostname", lambda: "h41n02")
    return rankfile


def test_detects_jsrun(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not LSFEnvironment.detect()
    for name, value in JSRUN_RANK_5.items():
        monkeypatch.setenv(name, value)
    assert LSFEnvironment.detect()


@pytest.mark.parametrize(
    "missing", ["LSB_JOBID", "JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_LOCAL_RANK"]
)
def test_not_detected_with_a_variable_missing(monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    for name, value in JSRUN_RANK_5.items():
        if name != missing:
            monkeypatch.setenv(name, value)
    assert not LSFEnvironment.detect()  # e.g. python run in the bsub script without jsrun


def test_values_from_rankfile(jsrun: Path) -> None:
    env = LSFEnvironment()
    assert env.creates_processes_externally
    assert env.main_address == "h41n01"  # the batch node is skipped
    assert env.main_port == 10000 + 318254 % 1000
    assert env.world_size() == 8
    assert env.global_rank() == 5
    assert env.local_rank() == 1
    assert env.node_rank() == 1
    assert env.processes_per_node() == 4


def test_hosts_from_lsb_mcpu_hosts_and_lsb_hosts(jsrun: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LSB_DJOB_RANKFILE")
    monkeypatch.setenv("LSB_MCPU_HOSTS", "launch 1 c1 4 c2 4")
    assert LSFEnvironment().main_address == "c1"
    monkeypatch.delenv("LSB_MCPU_HOSTS")
    monkeypatch.setenv("LSB_HOSTS", "launch c7 c7 c8 c8")
    assert LSFEnvironment().main_address == "c7"


def test_single_host_job_keeps_its_host(jsrun: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    jsrun.write_text("solo\nsolo\n")
    monkeypatch.setattr(lsf_module.socket, "gethostname", lambda: "solo.cluster.example")
    env = LSFEnvironment()
    assert env.main_address == "solo"
    assert env.node_rank() == 0  # FQDN from gethostname matches the short name in the rank file


def test_master_variables_override(jsrun: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "10.1.1.1")
    monkeypatch.setenv("MASTER_PORT", "23000")
    env = LSFEnvironment()
    assert (env.main_address, env.main_port) == ("10.1.1.1", 23000)


def test_unknown_host_raises(jsrun: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lsf_module.socket, "gethostname", lambda: "login1")
    with pytest.raises(RuntimeError, match=r"this host \(login1\) is not among the job's compute hosts"):
        LSFEnvironment().node_rank()


def test_no_hosts_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LSB_JOBID", "1")
    with pytest.raises(RuntimeError, match=r"no hosts found in LSB_DJOB_RANKFILE, LSB_MCPU_HOSTS or LSB_HOSTS"):
        _ = LSFEnvironment().main_address


def test_validate_settings(jsrun: Path) -> None:
    env = LSFEnvironment()
    env.validate_settings(num_devices=4, num_nodes=2)  # matches: no error
    with pytest.raises(ValueError, match=r"Fabric\(num_nodes=3\): the LSF job has 2 compute hosts \(LSB_DJOB_RANKFILE"):
        env.validate_settings(num_devices=4, num_nodes=3)
    with pytest.raises(ValueError, match=r"jsrun started 8 processes \(JSM_NAMESPACE_SIZE=8\), not 2 x 2"):
        env.validate_settings(num_devices=2, num_nodes=2)


def test_fabric_under_jsrun(jsrun: Path) -> None:
    fabric = Fabric(accelerator="cpu", devices=4, num_nodes=2)
    assert isinstance(fabric.strategy.cluster_environment, LSFEnvironment)
    assert (fabric.global_rank, fabric.local_rank, fabric.node_rank, fabric.world_size) == (5, 1, 1, 8)
    assert fabric.strategy.launcher is None

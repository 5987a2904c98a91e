"""KubeflowEnvironment: the variables the PyTorchJob operator sets on each pod (one process per pod)."""

from __future__ import annotations

import pytest

from fabric import Fabric
from fabric.environments import KubeflowEnvironment

pytestmark = pytest.mark.usefixtures("no_cluster_env")

# Worker pod 2 of a PyTorchJob with 1 master + 3 workers (training-operator, no torchrun in the container).
WORKER_2 = {
    "KUBERNETES_PORT": "tcp://10.96.0.1:443",
    "MASTER_ADDR": "mnist-master-0",
    "MASTER_PORT": "23456",
    "WORLD_SIZE": "4",
    "RANK": "3",
    "PYTHONUNBUFFERED": "1",
}


def _set(monkeypatch: pytest.MonkeyPatch, values: dict[str, str]) -> None:
    for name, value in values.items():
        monkeypatch.setenv(name, value)


def test_detects_pytorchjob_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not KubeflowEnvironment.detect()
    _set(monkeypatch, WORKER_2)
    assert KubeflowEnvironment.detect()


@pytest.mark.parametrize("missing", ["KUBERNETES_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"])
def test_not_detected_with_a_variable_missing(monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    _set(monkeypatch, {k: v for k, v in WORKER_2.items() if k != missing})
    assert not KubeflowEnvironment.detect()


@pytest.mark.parametrize("torchrun_var", ["LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"])
def test_not_detected_under_torchrun_in_the_pod(monkeypatch: pytest.MonkeyPatch, torchrun_var: str) -> None:
    _set(monkeypatch, {**WORKER_2, torchrun_var: "0"})
    assert not KubeflowEnvironment.detect()


def test_values(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, WORKER_2)
    env = KubeflowEnvironment()
    assert env.creates_processes_externally
    assert env.main_address == "mnist-master-0"
    assert env.main_port == 23456
    assert env.world_size() == 4
    assert env.global_rank() == 3
    assert env.node_rank() == 3
    assert env.local_rank() == 0
    assert env.processes_per_node() == 1


def test_validate_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, WORKER_2)
    env = KubeflowEnvironment()
    env.validate_settings(num_devices=1, num_nodes=4)  # matches: no error
    with pytest.raises(ValueError, match=r"Fabric\(devices=2\): a PyTorchJob pod runs one process.*torchrun"):
        env.validate_settings(num_devices=2, num_nodes=4)
    with pytest.raises(ValueError, match=r"Fabric\(num_nodes=2\): the PyTorchJob has 4 pods \(WORLD_SIZE=4\)"):
        env.validate_settings(num_devices=1, num_nodes=2)


def test_fabric_in_a_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, WORKER_2)
    fabric = Fabric(accelerator="cpu", devices="auto", num_nodes=4)
    assert isinstance(fabric.strategy.cluster_environment, KubeflowEnvironment)
    assert (fabric.global_rank, fabric.local_rank, fabric.node_rank, fabric.world_size) == (3, 0, 3, 4)
    assert fabric.strategy.launcher is None


def test_fabric_in_a_pod_with_too_many_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, WORKER_2)
    with pytest.raises(ValueError, match=r"Fabric\(devices=2\): a PyTorchJob pod runs one process"):
        Fabric(accelerator="cpu", devices=2, num_nodes=4)

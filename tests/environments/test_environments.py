"""Tests for the cluster environments: what each reads from the process environment, and detection order."""

from __future__ import annotations

import socket

import pytest

from fabric import DefaultEnvironment, LightningEnvironment, TorchElasticEnvironment
from fabric.environments import DETECTION_ORDER, detect_environment
from fabric.environments.default import find_free_port

pytestmark = pytest.mark.usefixtures("no_cluster_env")
_TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "node0.cluster",
    "MASTER_PORT": "29500",
}


def _set(monkeypatch: pytest.MonkeyPatch, values: dict[str, str]) -> None:
    for name, value in values.items():
        monkeypatch.setenv(name, value)


# -- DefaultEnvironment --------------------------------------------------------------------------------
def test_default_environment_picks_a_free_port_once() -> None:
    env = DefaultEnvironment()
    port = env.main_port
    assert isinstance(port, int)
    assert 0 < port < 65536
    assert env.main_port == port  # asked again: the same port, so every started process agrees
    assert env.main_address == "127.0.0.1"
    # the port was free when chosen: we can bind it ourselves
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_find_free_port_returns_a_bindable_port() -> None:
    port = find_free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
    assert port > 0


def test_default_environment_defaults_without_variables() -> None:
    env = DefaultEnvironment()
    assert DefaultEnvironment.detect()
    assert not env.creates_processes_externally
    assert env.local_rank() == 0
    assert env.node_rank() == 0
    assert env.world_size() is None
    assert env.global_rank() is None
    assert env.processes_per_node() is None


def test_default_environment_reads_the_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "4242", "NODE_RANK": "2", "LOCAL_RANK": "3"})
    env = DefaultEnvironment()
    assert env.main_address == "10.1.2.3"
    assert env.main_port == 4242
    assert env.node_rank() == 2
    assert env.local_rank() == 3


def test_default_environment_falls_back_to_group_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GROUP_RANK", "4")
    assert DefaultEnvironment().node_rank() == 4
    monkeypatch.setenv("NODE_RANK", "1")
    assert DefaultEnvironment().node_rank() == 1  # NODE_RANK wins


def test_default_environment_address_and_port_are_fixed_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_PORT", "1111")
    env = DefaultEnvironment()
    monkeypatch.setenv("MASTER_PORT", "2222")
    monkeypatch.setenv("MASTER_ADDR", "elsewhere")
    assert env.main_port == 1111
    assert env.main_address == "127.0.0.1"


def test_creates_processes_externally_follows_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    env = DefaultEnvironment()
    assert not env.creates_processes_externally
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert env.creates_processes_externally
    monkeypatch.delenv("LOCAL_RANK")
    assert not env.creates_processes_externally


def test_lightning_environment_is_the_default_environment() -> None:
    assert LightningEnvironment is DefaultEnvironment


# -- TorchElasticEnvironment ------------------------------------------------------------------------------
def test_torchelastic_detects_when_all_variables_are_set(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not TorchElasticEnvironment.detect()
    _set(monkeypatch, _TORCHRUN)
    assert TorchElasticEnvironment.detect()


@pytest.mark.parametrize("missing", sorted(_TORCHRUN))
def test_torchelastic_does_not_detect_with_a_variable_missing(monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    _set(monkeypatch, {k: v for k, v in _TORCHRUN.items() if k != missing})
    assert not TorchElasticEnvironment.detect()


def test_torchelastic_values(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, {**_TORCHRUN, "GROUP_RANK": "2", "LOCAL_WORLD_SIZE": "3"})
    env = TorchElasticEnvironment()
    assert env.creates_processes_externally
    assert env.main_address == "node0.cluster"
    assert env.main_port == 29500
    assert env.world_size() == 8
    assert env.global_rank() == 5
    assert env.local_rank() == 1
    assert env.node_rank() == 2
    assert env.processes_per_node() == 3


def test_torchelastic_node_rank_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, _TORCHRUN)
    env = TorchElasticEnvironment()
    assert env.node_rank() == 0
    assert env.processes_per_node() is None
    monkeypatch.setenv("NODE_RANK", "6")
    assert env.node_rank() == 6
    monkeypatch.setenv("GROUP_RANK", "7")
    assert env.node_rank() == 7  # torchrun's own variable wins


# -- detection ---------------------------------------------------------------------------------------------
def test_detection_order_checks_torchelastic_before_the_default() -> None:
    order = list(DETECTION_ORDER)
    assert order.index(TorchElasticEnvironment) < order.index(DefaultEnvironment)
    assert order[-1] is DefaultEnvironment, "the fallback always matches, so it must come last"


def test_detect_environment_without_variables_is_default() -> None:
    assert type(detect_environment()) is DefaultEnvironment


def test_detect_environment_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, _TORCHRUN)
    env = detect_environment()
    assert type(env) is TorchElasticEnvironment
    assert env.global_rank() == 5


def test_detect_environment_with_only_fabric_launcher_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    # fabric's own launchers set these, but not RANK: the default environment handles them
    _set(monkeypatch, {"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1234"})
    env = detect_environment()
    assert type(env) is DefaultEnvironment
    assert env.creates_processes_externally
    assert env.local_rank() == 1
    assert env.main_port == 1234

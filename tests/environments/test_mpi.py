"""MPIEnvironment. mpi4py is not installed here, so besides the "not installed" cases these tests inject a fake
``mpi4py`` module into sys.modules: a COMM_WORLD that plays one process of an mpirun job (rank, size, bcast,
allgather, Split_type). The fake answers collectives with what the other ranks would have sent."""

from __future__ import annotations

import subprocess
import sys
import types
from typing import Any

import pytest

from fabric import Fabric
from fabric.environments import MPIEnvironment
from fabric.environments import mpi as mpi_module

pytestmark = pytest.mark.usefixtures("no_cluster_env")


class FakeComm:
    """One process's view of a communicator; collectives return what the root / the other ranks send."""

    def __init__(self, rank: int, size: int, from_root: list[Any], gathered: list[Any] | None = None) -> None:
        self.rank, self.size = rank, size
        self.from_root, self.gathered = list(from_root), gathered
        self.local: FakeComm | None = None
        self.split_kinds: list[int] = []

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj if self.rank == root else self.from_root.pop(0)

    def allgather(self, obj: Any) -> list[Any]:
        assert self.gathered is not None and self.gathered[self.rank] == obj
        return self.gathered

    def Split_type(self, kind: int) -> FakeComm:
        self.split_kinds.append(kind)
        assert self.local is not None
        return self.local


def _install_fake_mpi4py(monkeypatch: pytest.MonkeyPatch, world: FakeComm) -> types.ModuleType:
    mpi = types.ModuleType("mpi4py.MPI")
    mpi.COMM_WORLD = world  # type: ignore[attr-defined]
    mpi.COMM_TYPE_SHARED = 42  # type: ignore[attr-defined]
    package = types.ModuleType("mpi4py")
    package.MPI = mpi  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mpi4py", package)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)
    return mpi


def _rank_5_of_8(monkeypatch: pytest.MonkeyPatch) -> FakeComm:
    """Rank 5 of `mpirun -np 8 --npernode 4` on two nodes: ranks 0-3 on node-a, 4-7 on node-b."""
    firsts = [0, None, None, None, 4, None, None, None]  # each node's first rank
    world = FakeComm(rank=5, size=8, from_root=["node-a", 29512], gathered=firsts)
    world.local = FakeComm(rank=1, size=4, from_root=[4])  # this node's first rank is 4
    _install_fake_mpi4py(monkeypatch, world)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "5")
    return world


@pytest.fixture(autouse=True)
def _no_mpi4py_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "mpi4py", raising=False)
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)


def test_import_fabric_does_not_import_mpi4py() -> None:
    code = "import sys, fabric, fabric.environments.mpi; print('mpi4py' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_not_detected_without_mpirun_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    world = FakeComm(rank=0, size=8, from_root=[])
    _install_fake_mpi4py(monkeypatch, world)
    assert not MPIEnvironment.detect()  # no launcher variables: mpi4py is not even asked
    monkeypatch.setenv("PMI_SIZE", "1")
    assert not MPIEnvironment.detect()  # a single MPI process is not a distributed job


def test_not_detected_without_mpi4py(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `import mpi4py` raise ImportError
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert not MPIEnvironment.detect()


def test_constructor_without_mpi4py_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(RuntimeError, match=r"MPIEnvironment\(\): mpi4py is not installed.*pip install mpi4py"):
        MPIEnvironment()


@pytest.mark.parametrize("size_var", ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"])
def test_detected_under_mpirun_with_mpi4py(monkeypatch: pytest.MonkeyPatch, size_var: str) -> None:
    _install_fake_mpi4py(monkeypatch, FakeComm(rank=0, size=4, from_root=[]))
    monkeypatch.setenv(size_var, "4")
    assert MPIEnvironment.detect()


def test_values(monkeypatch: pytest.MonkeyPatch) -> None:
    world = _rank_5_of_8(monkeypatch)
    env = MPIEnvironment()
    assert world.split_kinds == [42]  # the node-local communicator is a shared-memory split
    assert env.creates_processes_externally
    assert env.world_size() == 8
    assert env.global_rank() == 5
    assert env.local_rank() == 1
    assert env.node_rank() == 1
    assert env.processes_per_node() == 4
    assert env.main_address == "node-a"  # rank 0's hostname, received by broadcast
    assert env.main_port == 29512


def test_rank_0_chooses_address_and_port(monkeypatch: pytest.MonkeyPatch) -> None:
    world = FakeComm(rank=0, size=2, from_root=[], gathered=[0, None])
    world.local = FakeComm(rank=0, size=2, from_root=[])
    _install_fake_mpi4py(monkeypatch, world)
    monkeypatch.setattr(mpi_module.socket, "gethostname", lambda: "head-node")
    monkeypatch.setattr(mpi_module, "find_free_port", lambda: 31337)
    env = MPIEnvironment()
    assert (env.main_address, env.main_port, env.node_rank(), env.local_rank()) == ("head-node", 31337, 0, 0)


def test_validate_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    _rank_5_of_8(monkeypatch)
    env = MPIEnvironment()
    env.validate_settings(num_devices=4, num_nodes=2)  # matches: no error
    with pytest.raises(ValueError, match=r"Fabric\(devices=2\): mpirun started 4 processes on this node"):
        env.validate_settings(num_devices=2, num_nodes=2)
    with pytest.raises(ValueError, match=r"mpirun started 8 processes \(MPI COMM_WORLD size 8\), not 4 x 3"):
        env.validate_settings(num_devices=4, num_nodes=3)


def test_fabric_under_mpirun(monkeypatch: pytest.MonkeyPatch) -> None:
    _rank_5_of_8(monkeypatch)
    fabric = Fabric(accelerator="cpu", devices="auto", num_nodes=2)
    assert isinstance(fabric.strategy.cluster_environment, MPIEnvironment)
    assert (fabric.global_rank, fabric.local_rank, fabric.node_rank, fabric.world_size) == (5, 1, 1, 8)
    assert fabric.strategy.launcher is None

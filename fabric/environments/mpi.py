"""Processes started by mpirun / mpiexec: ranks, local rank and rendezvous agreed through mpi4py."""

from __future__ import annotations

import os
import socket
from typing import Any

from fabric.environments.cluster_environment import ClusterEnvironment
from fabric.environments.default import find_free_port
from fabric.utilities.exceptions import FabricValueError

# Set by the common launchers (Open MPI, MPICH/Hydra and Intel MPI, MVAPICH): a cheap check before importing mpi4py.
_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def _launcher_size() -> int:
    """The world size the MPI launcher announced in the environment, else 0."""
    for name in _SIZE_VARS:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


class MPIEnvironment(ClusterEnvironment):
    """Ranks from mpi4py's COMM_WORLD; mpi4py is imported when this environment is used, never at import time.

    The local rank comes from a shared-memory split of COMM_WORLD, the node rank from the order of each
    node's first process; rank 0 picks the main address (its hostname) and a free port and broadcasts both.
    """

    def __init__(self) -> None:
        try:
            from mpi4py import MPI
        except ImportError as err:
            raise RuntimeError(
                "MPIEnvironment(): mpi4py is not installed, so the MPI ranks cannot be read. "
                "Install it (pip install mpi4py) or let fabric pick another environment."
            ) from err
        self._world: Any = MPI.COMM_WORLD
        self._local: Any = self._world.Split_type(MPI.COMM_TYPE_SHARED)
        # rank 0 chooses and everyone receives, so all processes agree on one rendezvous
        self._main_address: str = self._world.bcast(socket.gethostname(), root=0)
        port = find_free_port() if self._world.Get_rank() == 0 else None
        self._main_port: int = self._world.bcast(port, root=0)
        self._node_rank = self._compute_node_rank()

    def _compute_node_rank(self) -> int:
        """Nodes are numbered by the global rank of their first process."""
        is_first = self._local.Get_rank() == 0
        firsts = self._world.allgather(self._world.Get_rank() if is_first else None)
        leader = self._local.bcast(self._world.Get_rank() if is_first else None, root=0)
        return sorted(rank for rank in firsts if rank is not None).index(leader)

    @property
    def creates_processes_externally(self) -> bool:
        """mpirun started every process."""
        return True

    @property
    def main_address(self) -> str:
        """Rank 0's hostname, broadcast to all."""
        return self._main_address

    @property
    def main_port(self) -> int:
        """A free port on rank 0, broadcast to all."""
        return self._main_port

    @staticmethod
    def detect() -> bool:
        """Launched by mpirun with more than one process, and mpi4py importable."""
        if _launcher_size() <= 1:
            return False  # checked first so a plain run never imports (and initialises) MPI
        try:
            from mpi4py import MPI
        except ImportError:
            return False
        return int(MPI.COMM_WORLD.Get_size()) > 1

    def world_size(self) -> int | None:
        """COMM_WORLD's size."""
        return int(self._world.Get_size())

    def global_rank(self) -> int | None:
        """COMM_WORLD's rank."""
        return int(self._world.Get_rank())

    def local_rank(self) -> int:
        """Rank within this node's shared-memory communicator."""
        return int(self._local.Get_rank())

    def node_rank(self) -> int:
        """This node's index, ordered by the global rank of each node's first process."""
        return self._node_rank

    def processes_per_node(self) -> int | None:
        """Size of this node's shared-memory communicator."""
        return int(self._local.Get_size())

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """devices must equal the processes on this node, and devices x num_nodes the MPI world size."""
        local = self.processes_per_node()
        if local != num_devices:
            raise FabricValueError(
                f"Fabric(devices={num_devices}): mpirun started {local} processes on this node "
                f"(MPI shared-memory communicator size {local}). Pass devices={local} or 'auto', or start "
                f"{num_devices} processes per node (mpirun --npernode {num_devices})."
            )
        size = self.world_size()
        if size != num_devices * num_nodes:
            raise FabricValueError(
                f"Fabric(devices={num_devices}, num_nodes={num_nodes}): mpirun started {size} processes "
                f"(MPI COMM_WORLD size {size}), not {num_devices} x {num_nodes}. "
                f"Pass num_nodes={max(size // num_devices, 1) if size else 1}, or match mpirun -np to it."
            )

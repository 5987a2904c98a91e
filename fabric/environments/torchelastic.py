"""Processes started by torchrun / torch.distributed.run (TorchElastic), or by hand with its variables."""

from __future__ import annotations

import os

from fabric.environments.cluster_environment import ClusterEnvironment
from fabric.utilities.exceptions import FabricValueError

_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class TorchElasticEnvironment(ClusterEnvironment):
    """Reads RANK, WORLD_SIZE, LOCAL_RANK, GROUP_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT."""

    @property
    def creates_processes_externally(self) -> bool:
        """torchrun started every process."""
        return True

    @property
    def ends_job_on_failure(self) -> bool:
        """torchrun's agent ends every worker when one fails."""
        return True

    @property
    def launcher_is_parent(self) -> bool:
        """torchrun's agent started this worker; it leaves its workers running if it is killed outright."""
        return True

    @property
    def main_address(self) -> str:
        """MASTER_ADDR."""
        return os.environ["MASTER_ADDR"]

    @property
    def main_port(self) -> int:
        """MASTER_PORT."""
        return int(os.environ["MASTER_PORT"])

    @staticmethod
    def detect() -> bool:
        """All of torchrun's rank variables are set."""
        return all(name in os.environ for name in _REQUIRED)

    def world_size(self) -> int | None:
        """WORLD_SIZE."""
        return int(os.environ["WORLD_SIZE"])

    def global_rank(self) -> int | None:
        """RANK."""
        return int(os.environ["RANK"])

    def local_rank(self) -> int:
        """LOCAL_RANK."""
        return int(os.environ["LOCAL_RANK"])

    def node_rank(self) -> int:
        """GROUP_RANK (torchrun's node rank), else NODE_RANK, else 0."""
        return int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", 0)))

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """devices must match LOCAL_WORLD_SIZE, and devices x num_nodes must match WORLD_SIZE."""
        per_node = self.processes_per_node()
        if per_node is not None and num_devices != per_node:
            raise FabricValueError(
                f"Fabric(devices={num_devices}): torchrun started {per_node} processes on this machine "
                f"(LOCAL_WORLD_SIZE={per_node}). Pass devices={per_node} or 'auto', or start as many processes "
                "as devices."
            )
        world = self.world_size()
        if world is not None and world != num_devices * num_nodes:
            raise FabricValueError(
                f"Fabric(devices={num_devices}, num_nodes={num_nodes}): torchrun started WORLD_SIZE={world} "
                f"processes, not {num_devices} x {num_nodes}. Pass num_nodes={max(world // num_devices, 1)}, "
                "or match devices and num_nodes to the torchrun command."
            )

    def processes_per_node(self) -> int | None:
        """LOCAL_WORLD_SIZE, when torchrun set it."""
        value = os.environ.get("LOCAL_WORLD_SIZE")
        return int(value) if value else None

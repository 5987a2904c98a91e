"""Processes that already joined torch.distributed's default process group before Fabric was created."""

from __future__ import annotations

import os

import torch.distributed as dist

from fabric.environments.cluster_environment import ClusterEnvironment
from fabric.utilities.exceptions import FabricValueError


class ProcessGroupEnvironment(ClusterEnvironment):
    """Uses the process group that the host program (a library, or the user) initialised itself.

    World size and global rank come from torch.distributed, not from variables: the program may have called
    init_process_group with explicit arguments and no torchrun variables at all. Fabric neither initialises
    another group nor destroys this one. An explicit devices=1 Fabric does not join the group at all: the connector
    gives it a single-device strategy, as Lightning Fabric does.
    """

    @property
    def creates_processes_externally(self) -> bool:
        """Every process exists already; Fabric must not start more."""
        return True

    @property
    def main_address(self) -> str:
        """Not needed (the group exists); MASTER_ADDR if set, else loopback, for code that only reports it."""
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        """Not needed (the group exists); MASTER_PORT if set, else 0, meaning unknown."""
        return int(os.environ.get("MASTER_PORT", 0))

    @staticmethod
    def detect() -> bool:
        """torch.distributed's default process group is initialised in this process."""
        return dist.is_available() and dist.is_initialized()

    def world_size(self) -> int | None:
        """The size of the existing default group."""
        return dist.get_world_size()

    def global_rank(self) -> int | None:
        """This process's rank in the existing default group."""
        return dist.get_rank()

    def processes_per_node(self) -> int | None:
        """LOCAL_WORLD_SIZE if set, else the whole world: without it, a group of N ranks on one machine is assumed.

        The connector resolves devices='auto' to this count, so an existing group of 2 gives DDP over 2 processes.
        A multi-machine group whose launcher does not set LOCAL_WORLD_SIZE must pass devices and num_nodes.
        """
        value = os.environ.get("LOCAL_WORLD_SIZE")
        return int(value) if value else dist.get_world_size()

    def local_rank(self) -> int:
        """LOCAL_RANK if set, else the global rank modulo the processes per node (one machine: the global rank)."""
        value = os.environ.get("LOCAL_RANK")
        if value:
            return int(value)
        per_node = self.processes_per_node() or 1
        return dist.get_rank() % per_node

    def node_rank(self) -> int:
        """GROUP_RANK or NODE_RANK if set, else the global rank divided by the processes per node."""
        value = os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK"))
        if value:
            return int(value)
        per_node = self.processes_per_node() or 1
        return dist.get_rank() // per_node

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """devices x num_nodes must equal the size of the existing group."""
        world = dist.get_world_size()
        if num_devices * num_nodes != world:
            raise FabricValueError(
                f"Fabric(devices={num_devices}, num_nodes={num_nodes}): torch.distributed is already initialised "
                f"with world size {world}, not {num_devices} x {num_nodes}. Pass devices='auto' (or devices and "
                "num_nodes whose product is the group's world size); Fabric uses the existing process group. For a "
                "single-process Fabric that leaves the group alone, pass devices=1 with strategy 'auto' or "
                "'single_device'."
            )

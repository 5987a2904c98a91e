"""The environment used when fabric starts the processes itself (one machine, or nodes started by hand)."""

from __future__ import annotations

import os
import socket

from fabric.environments.cluster_environment import ClusterEnvironment


def find_free_port(address: str = "127.0.0.1") -> int:
    """Ask the OS for a port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


class DefaultEnvironment(ClusterEnvironment):
    """Single machine by default; MASTER_ADDR, MASTER_PORT and NODE_RANK make it span machines."""

    def __init__(self) -> None:
        # The port is chosen once, here, so every process started from this object agrees on it.
        self._main_address = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = os.environ.get("MASTER_PORT")
        self._main_port = int(port) if port else find_free_port()

    @property
    def creates_processes_externally(self) -> bool:
        """Our own launcher sets LOCAL_RANK in the processes it starts."""
        return "LOCAL_RANK" in os.environ

    @property
    def main_address(self) -> str:
        """MASTER_ADDR or loopback."""
        return self._main_address

    @property
    def main_port(self) -> int:
        """MASTER_PORT or a free port picked at construction."""
        return self._main_port

    @staticmethod
    def detect() -> bool:
        """The fallback: always applicable."""
        return True

    def world_size(self) -> int | None:
        """Decided by the flags (devices x num_nodes)."""
        return None

    def global_rank(self) -> int | None:
        """Derived from node rank and local rank."""
        return None

    def local_rank(self) -> int:
        """LOCAL_RANK as set by fabric's launcher, else 0."""
        return int(os.environ.get("LOCAL_RANK", 0))

    def node_rank(self) -> int:
        """NODE_RANK (or GROUP_RANK), else 0."""
        return int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", 0)))


# Lightning Fabric users know this environment under that name.
LightningEnvironment = DefaultEnvironment

"""The ClusterEnvironment role: who am I in the job (ranks, world size, main address and port)."""

from __future__ import annotations

from abc import ABC, abstractmethod


class ClusterEnvironment(ABC):
    """Reads one scheduler's variables; the only place that knows about them."""

    @property
    @abstractmethod
    def creates_processes_externally(self) -> bool:
        """True when something other than fabric started every process (torchrun, srun, ...)."""

    @property
    @abstractmethod
    def main_address(self) -> str:
        """Address of the process that hosts the rendezvous store."""

    @property
    @abstractmethod
    def main_port(self) -> int:
        """Port of the rendezvous store."""

    @staticmethod
    @abstractmethod
    def detect() -> bool:
        """Whether this process runs under this environment."""

    @abstractmethod
    def world_size(self) -> int | None:
        """Total processes, or None when fabric's own launcher decides it from the flags."""

    @abstractmethod
    def global_rank(self) -> int | None:
        """This process's rank in the job, or None when derived from node and local rank."""

    @abstractmethod
    def local_rank(self) -> int:
        """This process's rank on its machine."""

    @abstractmethod
    def node_rank(self) -> int:
        """This machine's rank among the machines."""

    @property
    def ends_job_on_failure(self) -> bool:
        """True when the process that started the ranks ends them all as soon as one fails (torchrun's agent)."""
        return False

    @property
    def launcher_is_parent(self) -> bool:
        """True when the process that started this one supervises it (torchrun's agent), so this one must die
        with it; False when a scheduler's daemon (srun's slurmstepd) or fabric's own launcher started it."""
        return False

    def processes_per_node(self) -> int | None:
        """How many processes the scheduler started on this machine, if it says."""
        return None

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:  # noqa: B027 - optional check
        """Raise if the flags contradict what the scheduler started, naming its variable and value."""

    def teardown(self) -> None:  # noqa: B027 - optional hook
        """Undo anything set up for this environment."""

"""Pods of a Kubeflow PyTorchJob: one process per pod, node rank and node count from RANK and WORLD_SIZE."""

from __future__ import annotations

import os

from fabric.environments.cluster_environment import ClusterEnvironment
from fabric.utilities.exceptions import FabricValueError

_REQUIRED = ("KUBERNETES_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
# torchrun (or fabric's own launcher) inside the pod sets these; then that launcher's environment applies.
_EXCLUDED = ("LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


class KubeflowEnvironment(ClusterEnvironment):
    """Reads MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK as the PyTorchJob operator sets them on each pod.

    The operator counts pods: WORLD_SIZE is the number of pods and RANK the pod's index (0 for the master).
    Each pod runs one process, so local rank is 0 and node rank equals global rank. To run several processes
    per pod, start them with torchrun inside the pod; TorchElasticEnvironment then applies.
    """

    @property
    def creates_processes_externally(self) -> bool:
        """The operator started one process in every pod."""
        return True

    @property
    def main_address(self) -> str:
        """MASTER_ADDR (the master pod's service name)."""
        return os.environ["MASTER_ADDR"]

    @property
    def main_port(self) -> int:
        """MASTER_PORT."""
        return int(os.environ["MASTER_PORT"])

    @staticmethod
    def detect() -> bool:
        """Inside Kubernetes with the operator's variables, and no torchrun variables."""
        return all(name in os.environ for name in _REQUIRED) and not any(name in os.environ for name in _EXCLUDED)

    def world_size(self) -> int | None:
        """WORLD_SIZE: the number of pods, one process each."""
        return int(os.environ["WORLD_SIZE"])

    def global_rank(self) -> int | None:
        """RANK: the pod's index."""
        return int(os.environ["RANK"])

    def local_rank(self) -> int:
        """Always 0: one process per pod."""
        return 0

    def node_rank(self) -> int:
        """RANK: each pod is one node."""
        return int(os.environ["RANK"])

    def processes_per_node(self) -> int | None:
        """One process per pod."""
        return 1

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """devices must be 1 and num_nodes the number of pods."""
        if num_devices != 1:
            raise FabricValueError(
                f"Fabric(devices={num_devices}): a PyTorchJob pod runs one process (KubeflowEnvironment). "
                "Pass devices=1 or 'auto', or run torchrun --nproc_per_node inside each pod to use more devices."
            )
        pods = self.world_size()
        if pods != num_nodes:
            raise FabricValueError(
                f"Fabric(num_nodes={num_nodes}): the PyTorchJob has {pods} pods (WORLD_SIZE={pods}). "
                f"Pass num_nodes={pods}, or change the job's replica count."
            )

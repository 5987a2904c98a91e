"""Cluster environments: the only code that reads scheduler variables."""

from fabric.environments.cluster_environment import ClusterEnvironment
from fabric.environments.default import DefaultEnvironment, LightningEnvironment
from fabric.environments.existing_group import ProcessGroupEnvironment
from fabric.environments.kubeflow import KubeflowEnvironment
from fabric.environments.lsf import LSFEnvironment
from fabric.environments.mpi import MPIEnvironment
from fabric.environments.slurm import SLURMEnvironment
from fabric.environments.torchelastic import TorchElasticEnvironment
from fabric.environments.xla import XLAEnvironment

# Checked in this order; the first whose detect() is true wins. DefaultEnvironment always matches.
# XLAEnvironment is not in the list: the XLA strategies bring their own.
# SLURM comes first but steps aside when torchrun runs inside the allocation (see SLURMEnvironment.detect).
# One class per line, so an entry can be added or moved without touching the others.
DETECTION_ORDER: tuple[type[ClusterEnvironment], ...] = (
    ProcessGroupEnvironment,  # an initialised torch.distributed group outranks every variable
    SLURMEnvironment,
    TorchElasticEnvironment,
    KubeflowEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    DefaultEnvironment,
)


def detect_environment() -> ClusterEnvironment:
    """The environment this process runs in."""
    for env_cls in DETECTION_ORDER:
        if env_cls.detect():
            return env_cls()
    return DefaultEnvironment()


__all__ = [
    "DETECTION_ORDER",
    "ClusterEnvironment",
    "DefaultEnvironment",
    "KubeflowEnvironment",
    "LSFEnvironment",
    "LightningEnvironment",
    "MPIEnvironment",
    "ProcessGroupEnvironment",
    "SLURMEnvironment",
    "TorchElasticEnvironment",
    "XLAEnvironment",
    "detect_environment",
]

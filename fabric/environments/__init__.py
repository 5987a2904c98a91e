"""Cluster environments: the only code that reads scheduler variables."""

from fabric.environments.cluster_environment import ClusterEnvironment
from fabric.environments.default import DefaultEnvironment, LightningEnvironment
from fabric.environments.torchelastic import TorchElasticEnvironment

# Checked in this order; the first whose detect() is true wins. DefaultEnvironment always matches.
DETECTION_ORDER: tuple[type[ClusterEnvironment], ...] = (TorchElasticEnvironment, DefaultEnvironment)


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
    "LightningEnvironment",
    "TorchElasticEnvironment",
    "detect_environment",
]

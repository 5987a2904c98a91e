"""Lightning Fabric's import path ``plugins.environments.cluster_environment`` (a re-export)."""

from fabric.environments.cluster_environment import ClusterEnvironment

__all__ = ["ClusterEnvironment"]

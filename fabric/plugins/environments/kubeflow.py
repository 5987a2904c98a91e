"""Lightning Fabric's import path ``plugins.environments.kubeflow`` (a re-export)."""

from fabric.environments.kubeflow import KubeflowEnvironment

__all__ = ["KubeflowEnvironment"]

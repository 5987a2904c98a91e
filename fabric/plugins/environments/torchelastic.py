"""Lightning Fabric's import path ``plugins.environments.torchelastic`` (a re-export)."""

from fabric.environments.torchelastic import TorchElasticEnvironment

__all__ = ["TorchElasticEnvironment"]

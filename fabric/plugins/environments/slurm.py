"""Lightning Fabric's import path ``plugins.environments.slurm`` (a re-export)."""

from fabric.environments.slurm import SLURMEnvironment

__all__ = ["SLURMEnvironment"]

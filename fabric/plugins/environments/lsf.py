"""Lightning Fabric's import path ``plugins.environments.lsf`` (a re-export)."""

from fabric.environments.lsf import LSFEnvironment

__all__ = ["LSFEnvironment"]

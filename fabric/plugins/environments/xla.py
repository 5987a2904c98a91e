"""Lightning Fabric's import path ``plugins.environments.xla`` (a re-export)."""

from fabric.environments.xla import XLAEnvironment

__all__ = ["XLAEnvironment"]

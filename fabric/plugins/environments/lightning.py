"""Lightning Fabric's import path ``plugins.environments.lightning`` (a re-export)."""

from fabric.environments.default import LightningEnvironment

__all__ = ["LightningEnvironment"]

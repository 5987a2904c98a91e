"""Lightning Fabric's import path ``plugins.environments.lightning`` (a re-export)."""

from fabric.environments.default import LightningEnvironment
from fabric.environments.default import find_free_port as find_free_network_port

__all__ = ["LightningEnvironment", "find_free_network_port"]

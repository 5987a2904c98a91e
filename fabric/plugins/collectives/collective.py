"""Lightning Fabric's import path ``plugins.collectives.collective`` (a re-export)."""

from fabric.collectives.collective import Collective
from fabric.utilities.types import CollectibleGroup

__all__ = ["CollectibleGroup", "Collective"]

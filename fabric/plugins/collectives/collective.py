"""Lightning Fabric's import path ``plugins.collectives.collective`` (a re-export)."""

from fabric.collectives.collective import Collective

__all__ = ["Collective"]

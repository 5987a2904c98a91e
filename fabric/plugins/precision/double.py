"""Lightning Fabric's import path ``plugins.precision.double`` (a re-export)."""

from fabric.precision.double import DoublePrecision

__all__ = ["DoublePrecision"]

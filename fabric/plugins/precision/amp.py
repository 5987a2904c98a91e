"""Lightning Fabric's import path ``plugins.precision.amp`` (a re-export)."""

from fabric.precision.amp import MixedPrecision

__all__ = ["MixedPrecision"]

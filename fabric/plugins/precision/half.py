"""Lightning Fabric's import path ``plugins.precision.half`` (a re-export)."""

from fabric.precision.half import HalfPrecision

__all__ = ["HalfPrecision"]

"""Lightning Fabric's import path ``plugins.precision.xla`` (a re-export)."""

from fabric.precision.xla import XLAPrecision

__all__ = ["XLAPrecision"]

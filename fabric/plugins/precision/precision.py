"""Lightning Fabric's import path ``plugins.precision.precision`` (a re-export)."""

from fabric.precision.precision import Precision

__all__ = ["Precision"]

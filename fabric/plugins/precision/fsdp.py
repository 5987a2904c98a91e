"""Lightning Fabric's import path ``plugins.precision.fsdp`` (a re-export)."""

from fabric.precision.fsdp import FSDPPrecision

__all__ = ["FSDPPrecision"]

"""Lightning Fabric's import path ``plugins.precision.bitsandbytes`` (a re-export)."""

from fabric.precision.bitsandbytes import BitsandbytesPrecision

__all__ = ["BitsandbytesPrecision"]

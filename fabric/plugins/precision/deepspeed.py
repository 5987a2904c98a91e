"""Lightning Fabric's import path ``plugins.precision.deepspeed`` (a re-export)."""

from fabric.precision.deepspeed import DeepSpeedPrecision

__all__ = ["DeepSpeedPrecision"]

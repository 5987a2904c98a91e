"""Lightning Fabric's import path ``plugins.precision`` (a re-export)."""

from fabric.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

__all__ = ["DoublePrecision", "HalfPrecision", "MixedPrecision", "Precision"]

"""Lightning Fabric's ``plugins.precision`` import path: a re-export of fabric.precision."""

from fabric.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

__all__ = ["DoublePrecision", "HalfPrecision", "MixedPrecision", "Precision"]

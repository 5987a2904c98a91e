"""Lightning Fabric's ``plugins`` import path: re-exports of fabric.precision, fabric.environments and fabric.io."""

from fabric.environments import ClusterEnvironment
from fabric.io import CheckpointIO, TorchCheckpointIO
from fabric.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

__all__ = [
    "CheckpointIO",
    "ClusterEnvironment",
    "DoublePrecision",
    "HalfPrecision",
    "MixedPrecision",
    "Precision",
    "TorchCheckpointIO",
]

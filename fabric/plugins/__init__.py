"""Lightning Fabric's ``plugins`` import path: re-exports of fabric.precision, fabric.environments and fabric.io."""

from fabric.environments import ClusterEnvironment
from fabric.io import CheckpointIO, TorchCheckpointIO, XLACheckpointIO
from fabric.precision import (
    BitsandbytesPrecision,
    DeepSpeedPrecision,
    DoublePrecision,
    FSDPPrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
    TransformerEnginePrecision,
    XLAPrecision,
)

__all__ = [
    "BitsandbytesPrecision",
    "CheckpointIO",
    "ClusterEnvironment",
    "DeepSpeedPrecision",
    "DoublePrecision",
    "FSDPPrecision",
    "HalfPrecision",
    "MixedPrecision",
    "Precision",
    "TorchCheckpointIO",
    "TransformerEnginePrecision",
    "XLACheckpointIO",
    "XLAPrecision",
]

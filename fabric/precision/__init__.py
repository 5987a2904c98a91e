"""Precision plugins: the numeric policy of a run."""

from fabric.precision.amp import MixedPrecision
from fabric.precision.bitsandbytes import BitsandbytesPrecision
from fabric.precision.deepspeed import DeepSpeedPrecision
from fabric.precision.double import DoublePrecision
from fabric.precision.fsdp import FSDPPrecision
from fabric.precision.half import HalfPrecision
from fabric.precision.precision import Precision
from fabric.precision.transformer_engine import TransformerEnginePrecision
from fabric.precision.xla import XLAPrecision

__all__ = [
    "BitsandbytesPrecision",
    "DeepSpeedPrecision",
    "DoublePrecision",
    "FSDPPrecision",
    "HalfPrecision",
    "MixedPrecision",
    "Precision",
    "TransformerEnginePrecision",
    "XLAPrecision",
]

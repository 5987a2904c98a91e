"""Precision plugins: the numeric policy of a run.

The plugins tied to one strategy or one optional package are imported on first use (fabric._lazy).
"""

from typing import TYPE_CHECKING

from fabric import _lazy
from fabric.precision.amp import MixedPrecision
from fabric.precision.double import DoublePrecision
from fabric.precision.half import HalfPrecision
from fabric.precision.precision import Precision

if TYPE_CHECKING:
    from fabric.precision.bitsandbytes import BitsandbytesPrecision
    from fabric.precision.deepspeed import DeepSpeedPrecision
    from fabric.precision.fsdp import FSDPPrecision
    from fabric.precision.transformer_engine import TransformerEnginePrecision
    from fabric.precision.xla import XLAPrecision

__getattr__, __dir__ = _lazy.exports(
    __name__,
    {
        "BitsandbytesPrecision": "fabric.precision.bitsandbytes",
        "DeepSpeedPrecision": "fabric.precision.deepspeed",
        "FSDPPrecision": "fabric.precision.fsdp",
        "TransformerEnginePrecision": "fabric.precision.transformer_engine",
        "XLAPrecision": "fabric.precision.xla",
    },
)

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

"""Lightning Fabric's import path ``connector``: the flag types and the precision-name helper clients import.

fabric's own flag handling lives in ``fabric._connector``; this module only offers Lightning's private names.
"""

from __future__ import annotations

from typing import Literal, cast

from fabric.environments import ClusterEnvironment
from fabric.io import CheckpointIO
from fabric.precision import Precision
from fabric.precision._names import LEGACY_PRECISION
from fabric.utilities.exceptions import FabricValueError
from fabric.utilities.rank_zero import rank_zero_warn

_PRECISION_INPUT_INT = Literal[64, 32, 16]
_PRECISION_INPUT_STR_ALIAS = Literal["64", "32", "16", "bf16"]
_PRECISION_INPUT_STR = Literal[
    "transformer-engine",
    "transformer-engine-float16",
    "16-true",
    "16-mixed",
    "bf16-true",
    "bf16-mixed",
    "32-true",
    "64-true",
]
_PRECISION_INPUT = _PRECISION_INPUT_INT | _PRECISION_INPUT_STR | _PRECISION_INPUT_STR_ALIAS
_PLUGIN_INPUT = Precision | ClusterEnvironment | CheckpointIO

_UNIFIED = ("transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true", "bf16-mixed",
            "32-true", "64-true")  # fmt: skip


def _convert_precision_to_unified_args(precision: _PRECISION_INPUT | None) -> _PRECISION_INPUT_STR | None:
    """Lightning's spelling of a precision flag: 16 -> '16-mixed', 'bf16' -> 'bf16-mixed', 32 -> '32-true', ...

    The 16-bit shorthands warn, as in Lightning, since they hide that the result is mixed precision.
    """
    if precision is None:
        return None
    if precision in _UNIFIED:
        return cast(_PRECISION_INPUT_STR, precision)
    # `True == 1` and `16.0 == 16`: only real ints and strings are flag values.
    unified = LEGACY_PRECISION.get(precision) if isinstance(precision, (int, str)) and precision is not True else None
    if unified is None:
        raise FabricValueError(
            f"precision={precision!r}: this is no precision name. Use one of {', '.join(_UNIFIED)} "
            "(or the shorthands 64, 32, 16, '64', '32', '16', 'bf16')."
        )
    if str(precision) in ("16", "bf16"):
        rank_zero_warn(
            f"precision={precision!r} is a shorthand kept for old scripts; it means {unified!r}. "
            f"Write precision={unified!r} to say so."
        )
    return cast(_PRECISION_INPUT_STR, unified)


__all__ = [
    "_PLUGIN_INPUT",
    "_PRECISION_INPUT",
    "_PRECISION_INPUT_INT",
    "_PRECISION_INPUT_STR",
    "_PRECISION_INPUT_STR_ALIAS",
    "_convert_precision_to_unified_args",
]

"""XLAPrecision: the numeric policies XLA devices support, with torch_xla's optimizer step."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from fabric.precision._delegating import _DelegatingPrecision
from fabric.precision.amp import MixedPrecision
from fabric.precision.half import HalfPrecision
from fabric.precision.precision import Precision
from fabric.utilities.exceptions import FabricValueError

_SUPPORTED = ("32-true", "bf16-true", "bf16-mixed", "16-true")
_REFUSED = {
    "16-mixed": "float16 autocast needs loss scaling, which fabric does not offer on XLA; TPUs compute in bfloat16 "
    "natively. Use precision='bf16-mixed' (or 'bf16-true')",
    "64-true": "TPUs have no float64 arithmetic. Use precision='32-true'",
}


class XLAPrecision(_DelegatingPrecision):
    """`32-true`, `bf16-true`, `bf16-mixed` (autocast on the XLA device) or `16-true` on XLA devices.

    Every optimizer step goes through `xm.optimizer_step`: gradients are averaged across processes (the XLA
    strategy has no DDP wrapper that would do it in backward), the step runs, and the lazy graph is executed.
    """

    def __init__(self, precision: str = "32-true") -> None:
        if precision in _REFUSED:
            raise FabricValueError(f"XLAPrecision(precision={precision!r}): {_REFUSED[precision]}.")
        if precision not in _SUPPORTED:
            raise FabricValueError(
                f"XLAPrecision(precision={precision!r}): unknown precision for XLA. Use one of {', '.join(_SUPPORTED)}."
            )
        self.precision = precision
        self._policy: Precision = Precision()
        if precision in ("bf16-true", "16-true"):
            self._policy = HalfPrecision(precision)  # type: ignore[arg-type]
        elif precision == "bf16-mixed":
            self._policy = MixedPrecision("bf16-mixed", device="xla")
        self.changes_forward = self._policy.changes_forward

    @property
    def dtype(self) -> torch.dtype:
        """The dtype parameters are held in (float32 under autocast)."""
        return {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(self.precision, torch.float32)

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Average gradients across processes, step, and execute the pending graph (one `mark_step` per step)."""
        import torch_xla.core.xla_model as xm

        return xm.optimizer_step(optimizer, optimizer_args=kwargs, barrier=True)

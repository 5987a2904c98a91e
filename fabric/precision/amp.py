"""`16-mixed` and `bf16-mixed`: torch.autocast, with a gradient scaler for float16."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric.precision.precision import Precision, _convert_floating
from fabric.utilities.exceptions import FabricTypeError, FabricValueError


class MixedPrecision(Precision):
    """Autocast on `device_type`; `16-mixed` on CUDA scales the loss to avoid float16 underflow."""

    changes_forward = True

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"],
        device: str = "cuda",
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        if precision not in ("16-mixed", "bf16-mixed"):
            raise FabricValueError(
                f"MixedPrecision(precision={precision!r}): unsupported value. Use '16-mixed' or 'bf16-mixed'."
            )
        if scaler is not None and precision == "bf16-mixed":
            raise FabricValueError(
                "MixedPrecision(precision='bf16-mixed', scaler=...): bfloat16 has float32's range and needs no "
                "loss scaling. Drop the scaler, or use precision='16-mixed'."
            )
        if scaler is None and precision == "16-mixed" and device in ("cuda", "mps"):
            # float16 gradients underflow without loss scaling on any GPU; MPS has its own GradScaler too.
            scaler = torch.amp.GradScaler(device)
        self.precision = precision
        self.device = device
        self.scaler = scaler
        self._dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16

    def forward_context(self) -> AbstractContextManager:
        """Autocast to the 16-bit dtype."""
        return torch.autocast(self.device, dtype=self._dtype)

    def convert_input(self, data: Any) -> Any:
        """Autocast does not touch the inputs themselves; match them to the compute dtype."""
        return _convert_floating(data, self._dtype)

    def convert_output(self, data: Any) -> Any:
        """Give the loss computation outputs in the default dtype."""
        return _convert_floating(data, torch.get_default_dtype())

    @property
    def requires_fabric_backward(self) -> bool:
        """With a scaler, the loss must be scaled before backward."""
        return self.scaler is not None

    @property
    def has_loss_scaler(self) -> bool:
        """True for float16 with a scaler."""
        return self.scaler is not None

    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """Scale, then backward."""
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        tensor.backward(*args, **kwargs)

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Let the scaler skip steps with inf/nan gradients and adapt its scale."""
        if self.scaler is None:
            return optimizer.step(**kwargs)
        if "closure" in kwargs and kwargs["closure"] is not None:
            raise FabricTypeError(
                "optimizer.step(closure=...): a closure cannot be used with precision='16-mixed', because the "
                "gradient scaler must see the gradients before the step. Call the closure yourself first."
            )
        kwargs.pop("closure", None)
        result = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return result

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale in place so clipping sees true gradient norms."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, so a resumed run keeps its loss scale."""
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scaler's state."""
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)

"""`.device` and `.dtype` on a module, kept up to date by `.to()`, `.cuda()`, `.half()` and the like."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Module

# Lightning's LightningModule derives from a mixin of this name too; matching by name keeps its `.device` in step
# without importing lightning.
_MIXIN_NAME = "_DeviceDtypeModuleMixin"


class _DeviceDtypeModuleMixin(Module):
    """A module that reports the device and dtype it was last moved or cast to."""

    __jit_unused_properties__: list[str] = ["device", "dtype"]

    def __init__(self) -> None:
        super().__init__()
        self._dtype: str | torch.dtype = torch.get_default_dtype()
        self._device: torch.device = torch.get_default_device()

    @property
    def dtype(self) -> str | torch.dtype:
        """The dtype the module was created in or last cast to."""
        return self._dtype

    @dtype.setter
    def dtype(self, new_dtype: str | torch.dtype) -> None:
        raise RuntimeError(
            f"module.dtype = {new_dtype}: the dtype cannot be assigned, it follows the parameters. "
            f"Cast the module instead: module.to({new_dtype})."
        )

    @property
    def device(self) -> torch.device:
        """The device the module was last moved to (CUDA always with its index)."""
        device = self._device
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """`Module.to`, remembering the target device and dtype."""
        device, dtype = torch._C._nn._parse_to(*args, **kwargs)[:2]
        update_device_dtype(self, device=device, dtype=dtype)
        return super().to(*args, **kwargs)

    def cuda(self, device: torch.device | int | None = None) -> Any:
        """`Module.cuda`, remembering the device."""
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif isinstance(device, int):
            device = torch.device("cuda", device)
        update_device_dtype(self, device=device)
        return super().cuda(device=device)

    def cpu(self) -> Any:
        """`Module.cpu`, remembering the device."""
        update_device_dtype(self, device=torch.device("cpu"))
        return super().cpu()

    def type(self, dst_type: str | torch.dtype) -> Any:
        """`Module.type`, remembering the dtype."""
        update_device_dtype(self, dtype=dst_type)
        return super().type(dst_type)

    def float(self) -> Any:
        """`Module.float`, remembering the dtype."""
        update_device_dtype(self, dtype=torch.float)
        return super().float()

    def double(self) -> Any:
        """`Module.double`, remembering the dtype."""
        update_device_dtype(self, dtype=torch.double)
        return super().double()

    def half(self) -> Any:
        """`Module.half`, remembering the dtype."""
        update_device_dtype(self, dtype=torch.half)
        return super().half()

    def bfloat16(self) -> Any:
        """`Module.bfloat16`, remembering the dtype."""
        update_device_dtype(self, dtype=torch.bfloat16)
        return super().bfloat16()


def _is_mixin(module: Module) -> bool:
    return any(cls.__name__ == _MIXIN_NAME for cls in type(module).__mro__)


def update_device_dtype(
    root: Module, device: torch.device | None = None, dtype: str | torch.dtype | None = None
) -> None:
    """Record `device`/`dtype` on every device-aware module in `root` (ours and LightningModules), moving nothing."""
    for module in root.modules():
        if not _is_mixin(module):
            continue
        # setattr: Module.__setattr__'s type hints only allow tensors and modules.
        if device is not None:
            setattr(module, "_device", device)  # noqa: B010 - Module's attribute type hints reject a device
        if dtype is not None:
            setattr(module, "_dtype", dtype)  # noqa: B010

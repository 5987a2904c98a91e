"""SingleDeviceXLAStrategy (`single_xla`): this process on one XLA device."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric.accelerators.accelerator import Accelerator
from fabric.checkpoint import state as _checkpoint
from fabric.io.checkpoint_io import CheckpointIO
from fabric.precision.precision import Precision
from fabric.strategies.single_device import SingleDeviceStrategy
from fabric.strategies.xla import _common

if TYPE_CHECKING:
    from torch.utils.data import DataLoader


class SingleDeviceXLAStrategy(SingleDeviceStrategy):
    """One process, one XLA device (a TPU core, or a CPU PJRT device in tests); no launcher, no collectives."""

    drives_xla = True

    def __init__(
        self,
        device: int | str | torch.device | None = None,
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
    ) -> None:
        # An int is an XLA device index (Lightning's spelling), not a CUDA one as torch.device(int) would read it.
        if isinstance(device, int):
            device = torch.device("xla", device)
        super().__init__(device=device, accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision)
        _common.check_components("single_xla", accelerator, precision)
        self._moves = _common.ParameterMoves()

    def _connect(self, **components: Any) -> None:
        """Check that the connector's accelerator and precision are XLA's."""
        components["checkpoint_io"] = _common.default_checkpoint_io(components["checkpoint_io"])
        super()._connect(**components)
        _common.check_components("single_xla", self._accelerator, self._precision)

    def _precision_plugin(self, name: str, device_type: str) -> Precision | None:
        """XLAPrecision for every precision given by name."""
        from fabric.precision.xla import XLAPrecision

        return XLAPrecision(name)

    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """Backward through the precision plugin; an autograd engine sized before XLA started is explained."""
        with _common.explain_early_backward():
            super().backward(tensor, module, *args, **kwargs)

    def setup_environment(self) -> None:
        """Load torch_xla, which registers the XLA device with torch, then select the device."""
        import torch_xla  # noqa: F401

        super().setup_environment()

    def module_to_device(self, module: Module) -> None:
        """Move the module to the XLA device, remembering which new parameters replaced the CPU ones."""
        self._moves.move(module, self.root_device)

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Point an optimizer created before the move at the parameters on the device."""
        self._moves.update(optimizer)
        return optimizer

    def process_dataloader(self, dataloader: DataLoader, *, even_batches: bool = True) -> DataLoader:
        """The whole dataset (every sample once, whatever even_batches says), with batches brought to the device
        by torch_xla's background loader."""
        return _common.device_loader(dataloader, self.root_device)

    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Write the state with CPU tensors, so the file loads on machines without torch_xla."""
        from fabric.io.xla import xla_state_to_cpu

        converted = _checkpoint.convert_state(state, self.get_module_state_dict, self.get_optimizer_state, filter)
        self.checkpoint_io.save_checkpoint(xla_state_to_cpu(converted), path, storage_options=storage_options)

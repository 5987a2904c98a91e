"""One process on one device: collectives are identities, the dataloader is left as it is."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn import Module

from fabric.accelerators.accelerator import Accelerator
from fabric.io.checkpoint_io import CheckpointIO
from fabric.precision.precision import Precision
from fabric.strategies._one_process import OneProcessStrategy


class SingleDeviceStrategy(OneProcessStrategy):
    """Runs everything in this process on `device`."""

    repeatable_module_setup = True  # nothing wraps the module

    def __init__(
        self,
        device: str | torch.device | None = None,
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision)
        self._device = torch.device(device) if device is not None else None

    def _connect(self, *, parallel_devices: list[torch.device], **components: Any) -> None:
        """Take the one device the connector resolved, unless the user named one."""
        super()._connect(parallel_devices=parallel_devices, **components)
        if self._device is None:
            self._device = parallel_devices[0]

    @property
    def root_device(self) -> torch.device:
        """The one device."""
        return self._device if self._device is not None else torch.device("cpu")

    def setup_module(self, module: Module) -> Module:
        """Nothing to wrap."""
        return module

    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: str = "mean") -> Tensor:
        """One process: the tensor itself."""
        from fabric.utilities.distributed import check_reduce_op

        check_reduce_op(reduce_op)
        return tensor

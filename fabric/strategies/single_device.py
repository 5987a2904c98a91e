"""One process on one device: collectives are identities, the dataloader is left as it is."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn import Module

from fabric.accelerators.accelerator import Accelerator
from fabric.io.checkpoint_io import CheckpointIO
from fabric.precision.precision import Precision
from fabric.strategies.strategy import Strategy

if TYPE_CHECKING:
    from torch.utils.data import DataLoader


class SingleDeviceStrategy(Strategy):
    """Runs everything in this process on `device`."""

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

    @property
    def global_rank(self) -> int:
        """Always 0."""
        return 0

    @property
    def local_rank(self) -> int:
        """Always 0."""
        return 0

    @property
    def node_rank(self) -> int:
        """Always 0."""
        return 0

    @property
    def world_size(self) -> int:
        """Always 1."""
        return 1

    @property
    def is_global_zero(self) -> bool:
        """Always True."""
        return True

    def setup_environment(self) -> None:
        """Select the device."""
        if self.accelerator is not None:
            self.accelerator.setup_device(self.root_device)

    def setup_module(self, module: Module) -> Module:
        """Nothing to wrap."""
        return module

    def process_dataloader(self, dataloader: DataLoader) -> DataLoader:
        """A single process reads the whole dataset."""
        return dataloader

    def barrier(self, name: str | None = None) -> None:
        """Nobody to wait for."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """The object is already everywhere."""
        return obj

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """One process: the tensor itself (no added dimension, as in Lightning Fabric)."""
        return tensor

    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: str = "mean") -> Tensor:
        """One process: the tensor itself."""
        from fabric.utilities.distributed import check_reduce_op

        check_reduce_op(reduce_op)
        return tensor

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        """No gradients to synchronise."""
        return nullcontext()

"""What every strategy that runs in one process shares: rank 0 of 1, identity collectives, loaders left alone."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from torch import Tensor
from torch.nn import Module

from fabric.strategies.strategy import Strategy

if TYPE_CHECKING:
    from torch.utils.data import DataLoader


class OneProcessStrategy(Strategy):
    """The base of the single-process strategies (`single_device`, `dp`); subclasses place the module."""

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
        """Always 1: one process."""
        return 1

    @property
    def is_global_zero(self) -> bool:
        """Always True."""
        return True

    def setup_environment(self) -> None:
        """Select the (first) device."""
        if self.accelerator is not None:
            self.accelerator.setup_device(self.root_device)

    def process_dataloader(self, dataloader: DataLoader, *, even_batches: bool = True) -> DataLoader:
        """The one process reads the whole dataset, every sample once, whatever even_batches says."""
        return dataloader

    def barrier(self, name: str | None = None) -> None:
        """Nobody to wait for."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """The object is already everywhere."""
        return obj

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """One process: the tensor itself (no added dimension, as in Lightning Fabric)."""
        return tensor

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        """No later gradient synchronisation to skip."""
        return nullcontext()

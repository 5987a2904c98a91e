"""The Strategy role: all distributed behaviour; owns accelerator, precision, checkpoint IO, launcher, environment."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric.strategies._base import _StrategyComponents

if TYPE_CHECKING:
    from torch.utils.data import DataLoader


class Strategy(_StrategyComponents, ABC):
    """What every strategy answers; shared behaviour lives in `_StrategyComponents`."""

    @property
    @abstractmethod
    def root_device(self) -> torch.device:
        """The device this process computes on."""

    @property
    @abstractmethod
    def global_rank(self) -> int:
        """Rank of this process among all processes."""

    @property
    @abstractmethod
    def local_rank(self) -> int:
        """Rank of this process on its machine."""

    @property
    @abstractmethod
    def node_rank(self) -> int:
        """Rank of this machine."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Number of processes."""

    @abstractmethod
    def setup_environment(self) -> None:
        """Prepare this process: select the device, join the process group."""

    @abstractmethod
    def setup_module(self, module: Module) -> Module:
        """Wrap the module for this strategy (DDP, ...); it is already on the device."""

    @abstractmethod
    def process_dataloader(self, dataloader: DataLoader, *, even_batches: bool = True) -> DataLoader:
        """Return a loader whose sampling is right for this strategy; even_batches=False: no padded samples."""

    @abstractmethod
    def barrier(self, name: str | None = None) -> None:
        """Wait for every process."""

    @abstractmethod
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object from rank `src` to all."""

    @abstractmethod
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Gather a tensor from every process."""

    @abstractmethod
    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: str = "mean") -> Tensor:
        """Reduce a tensor across processes."""

    @abstractmethod
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        """Skip gradient synchronisation inside this context (gradient accumulation)."""

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Prepare an optimizer whose parameters are already set up."""
        return optimizer

    def setup_module_and_optimizers(
        self, module: Module, optimizers: Iterable[Optimizer]
    ) -> tuple[Module, list[Optimizer]]:
        """Set up a model with its optimizers; joint strategies (DeepSpeed) override this."""
        return self.setup_module(module), [self.setup_optimizer(opt) for opt in optimizers]

"""The DataLoader wrapper returned by ``setup_dataloaders``: epochs for the sampler, batches on the device."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from fabric.utilities.exceptions import FabricValueError

if TYPE_CHECKING:
    from torch.utils.data import DataLoader


def _find_set_epoch(dataloader: DataLoader) -> Callable[[int], None] | None:
    """The ``set_epoch`` of the loader's sampler, else of its batch sampler's sampler, if either has one."""
    set_epoch = getattr(dataloader.sampler, "set_epoch", None)
    if callable(set_epoch):
        return set_epoch
    set_epoch = getattr(getattr(dataloader.batch_sampler, "sampler", None), "set_epoch", None)
    return set_epoch if callable(set_epoch) else None


class _FabricDataLoader:
    """Wraps a DataLoader: tells its sampler the epoch and moves each batch to the device."""

    def __init__(
        self,
        dataloader: DataLoader,
        device: torch.device | None = None,
        move_fn: Callable[[Any, torch.device], Any] | None = None,
    ) -> None:
        if device is not None and move_fn is None:
            raise FabricValueError(
                f"_FabricDataLoader(device={device}): no move_fn was given, so batches cannot be moved "
                "to the device. Pass move_fn, or device=None to yield batches as they are."
            )
        self._dataloader = dataloader
        self._device = device
        self._move_fn = move_fn
        self._epoch = 0
        # A DataLoader forbids replacing its sampler after construction, so the lookup is done once.
        self._set_epoch = _find_set_epoch(dataloader)

    @property
    def device(self) -> torch.device | None:
        """The device batches are moved to, or None when they are yielded as the loader makes them."""
        return self._device

    @property
    def dataloader(self) -> DataLoader:
        """The wrapped, original DataLoader."""
        return self._dataloader

    def __len__(self) -> int:
        return len(self._dataloader)

    def __iter__(self) -> Iterator[Any]:
        # Not a generator itself: the epoch must reach the sampler when iteration starts, before
        # iter(dataloader) draws the indices, even if no batch is ever requested.
        if self._set_epoch is not None:
            self._set_epoch(self._epoch)
        self._epoch += 1
        iterator = iter(self._dataloader)
        if self._device is None:
            return iterator
        return self._moved(iterator, self._device)

    def _moved(self, iterator: Iterator[Any], device: torch.device) -> Iterator[Any]:
        move_fn = self._move_fn
        assert move_fn is not None  # checked in __init__
        for batch in iterator:
            yield move_fn(batch, device)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes this wrapper lacks. While unpickling, `_dataloader` is not
        # set yet, and reading it through `self` would call __getattr__ again without end.
        dataloader = self.__dict__.get("_dataloader")
        if dataloader is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        return getattr(dataloader, name)

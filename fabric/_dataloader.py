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


def _length(dataloader: DataLoader) -> int | None:
    from fabric.utilities.data import sized_len

    return sized_len(dataloader)


def _sampler_generator(dataloader: DataLoader) -> torch.Generator | None:
    """The generator of a shuffling sampler that keeps one across epochs (torchdata's RandomSampler)."""
    from fabric.utilities._loader_state import _active_sampler

    generator = getattr(_active_sampler(dataloader), "generator", None)
    return generator if isinstance(generator, torch.Generator) else None


def _sampler_generator_state(dataloader: DataLoader) -> torch.Tensor | None:
    # At an epoch boundary the generator decides every later epoch's order, so it is saved with the epoch.
    generator = _sampler_generator(dataloader)
    return None if generator is None else generator.get_state()


class _FabricDataLoader:
    """Wraps a DataLoader: tells its sampler the epoch and moves each batch to the device."""

    def __init__(
        self,
        dataloader: DataLoader,
        device: torch.device | None = None,
        move_fn: Callable[[Any, torch.device], Any] | None = None,
        rank: int = 0,
        world_size: int = 1,
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
        # Whether the latest iteration has batches left: then a saved state is a position inside that epoch.
        self._mid_epoch = False
        self._batches = 0  # batches yielded in the latest iteration (for messages; the loader keeps its own count)
        self._rank = rank
        self._world_size = world_size
        # torch's global RNG state from a loaded state, and whether it is put back after the iterator exists.
        self._pending_rng: tuple[torch.Tensor, bool] | None = None
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

    @property
    def world_size(self) -> int:
        """The number of processes the loader was set up for (each reads its own shard)."""
        return self._world_size

    def __len__(self) -> int:
        return len(self._dataloader)

    def __iter__(self) -> Iterator[Any]:
        # Not a generator itself: the epoch must reach the sampler when iteration starts, before
        # iter(dataloader) draws the indices, even if no batch is ever requested.
        if self._set_epoch is not None:
            self._set_epoch(self._epoch)
        self._epoch += 1
        self._mid_epoch = True
        self._batches = 0
        pending, self._pending_rng = self._pending_rng, None
        if pending is not None and not pending[1]:
            torch.set_rng_state(pending[0])  # a new epoch draws its order from the saved global state
        iterator = iter(self._dataloader)
        if pending is not None and pending[1]:
            # After the iterator exists: creating it draws from the global RNG, which the saved run did not.
            torch.set_rng_state(pending[0])
        return self._tracked(iterator, self._device)

    def _tracked(self, iterator: Iterator[Any], device: torch.device | None) -> Iterator[Any]:
        # Counts batches and notes the end of the epoch, so that a state saved now knows where it is.
        move_fn = self._move_fn
        for batch in iterator:
            self._batches += 1
            yield batch if device is None or move_fn is None else move_fn(batch, device)
        self._mid_epoch = False

    def state_dict(self) -> dict[str, Any]:
        """This rank's position: the epoch, and inside it the loader's own state (torchdata's StatefulDataLoader).

        ``fabric.save`` gathers the states of all ranks into the checkpoint, so that each rank gets its own back.
        """
        from fabric.utilities import _loader_state

        if not _loader_state.is_stateful(self._dataloader):
            raise _loader_state.unsupported(self._dataloader)
        # After the epoch's last batch the iterator has not raised StopIteration yet, but nothing is left: a boundary.
        mid_epoch = self._mid_epoch and self._batches != _length(self._dataloader)
        state: dict[str, Any] = {
            # Inside an epoch: the epoch being read. At a boundary: the epoch the next iteration starts.
            "epoch": self._epoch - 1 if mid_epoch else self._epoch,
            "mid_epoch": mid_epoch,
            "batches": self._batches if mid_epoch else 0,
            "fingerprint": _loader_state.fingerprint(self._dataloader),
            "loader": self._dataloader.state_dict() if mid_epoch else None,  # type: ignore[attr-defined]
            "generator": None if mid_epoch else _sampler_generator_state(self._dataloader),
            # A shuffling sampler without a generator draws every later epoch from torch's global RNG, as in PyTorch.
            "global_rng": torch.get_rng_state() if _loader_state.draws_from_global_rng(self._dataloader) else None,
        }
        return _loader_state.entry({str(self._rank): state}, self._world_size)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a saved position: the next iteration resumes the saved epoch after its last batch."""
        from fabric.utilities import _loader_state

        if not _loader_state.is_stateful(self._dataloader):
            raise _loader_state.unsupported(self._dataloader)
        state = _loader_state.rank_state(state_dict, self._rank, self._world_size)
        # Across world sizes the sampler may differ (a RandomSampler on one process, a seeded DistributedSampler on
        # more): both shuffle, but only one has a seed. Only an epoch boundary gets this far (see rank_state).
        changed = state_dict["world_size"] != self._world_size
        ignore = ("seed",) if changed else ()
        _loader_state.check_fingerprint(state["fingerprint"], _loader_state.fingerprint(self._dataloader), ignore)
        self._epoch = state["epoch"]
        self._mid_epoch = False
        self._batches = 0
        # An empty dict drops any iterator in flight: the next iteration starts the epoch afresh.
        self._dataloader.load_state_dict(state["loader"] if state["mid_epoch"] else {})  # type: ignore[attr-defined]
        if state["generator"] is not None:
            _sampler_generator(self._dataloader).set_state(state["generator"])  # type: ignore[union-attr]
        if state.get("global_rng") is not None:
            self._pending_rng = (state["global_rng"], state["mid_epoch"])

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes this wrapper lacks. While unpickling, `_dataloader` is not
        # set yet, and reading it through `self` would call __getattr__ again without end.
        dataloader = self.__dict__.get("_dataloader")
        if dataloader is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        return getattr(dataloader, name)

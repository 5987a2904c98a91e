"""The DataLoader wrapper returned by ``setup_dataloaders``: epochs for the sampler, batches on the device."""

from __future__ import annotations

import weakref
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
    """Wraps a DataLoader: tells its sampler the epoch and moves each batch to the device.

    Nothing runs per batch beyond the move: a save reads the position from the loader's own iterator.
    """

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
        # The loader's iterator of the latest epoch: how many batches it gave, and whether it ended, is the position.
        self._current: Iterator[Any] | None = None
        self._rank = rank
        self._world_size = world_size
        # torch's global RNG state from a loaded state, and whether it is put back after the iterator exists.
        self._pending_rng: tuple[torch.Tensor, bool] | None = None
        # A DataLoader forbids replacing its sampler after construction, so the lookup is done once.
        self._set_epoch = _find_set_epoch(dataloader)
        # Set by setup_dataloaders (see _configure): gc.freeze() around forking workers, and the optimizer steps.
        self._freeze_gc = False
        self._steps: _StepWatch | None = None
        self._stepped_at = 0  # batches of the latest epoch given out when an optimizer last stepped

    def _configure(self, freeze_gc: bool, steps: _StepWatch | None) -> None:
        """Options of setup_dataloaders that the strategy's processing does not see."""
        self._freeze_gc = freeze_gc
        self._steps = steps
        if steps is not None:
            steps.add_loader(self)

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
        self._stepped_at = 0
        if self._steps is not None:
            self._steps.attach()  # optimizers set up after this loader
        pending, self._pending_rng = self._pending_rng, None
        if pending is not None and not pending[1]:
            torch.set_rng_state(pending[0])  # a new epoch draws its order from the saved global state
        iterator = _start(self._dataloader, self._freeze_gc)
        self._current = iterator
        if pending is not None and pending[1]:
            # After the iterator exists: creating it draws from the global RNG, which the saved run did not.
            torch.set_rng_state(pending[0])
        device, move_fn = self._device, self._move_fn
        if device is None or move_fn is None:
            return iterator  # the loader's own iterator: a plain loop pays nothing per batch
        return (move_fn(batch, device) for batch in iterator)

    def _yielded(self) -> int:
        return getattr(self._current, "_num_yielded", 0)

    def _on_step(self) -> None:
        # Called after every optimizer step (see _StepWatch): the batch given out last has been used.
        self._stepped_at = self._yielded()

    def _position(self) -> tuple[bool, int, bool]:
        """(inside an epoch, batches the loop has used, whether the batch given out last is left out of them)."""
        iterator = self._current
        if iterator is None:
            return False, 0, False
        yielded = self._yielded()
        # A batch the loop holds but no optimizer step has used yet (a preemption check at the top of the loop
        # body) is not counted: a resumed run gives it again. Only in a loop whose fabric has optimizers.
        unused = self._steps is not None and self._steps.active and self._stepped_at < yielded
        used = yielded - 1 if unused else yielded
        # After the epoch's last batch the iterator has not raised StopIteration yet, but nothing is left: a boundary.
        ended = used == _length(self._dataloader) or _asked_past_the_end(iterator)
        return not ended, used, unused

    def state_dict(self) -> dict[str, Any]:
        """This rank's position: the epoch, and inside it the loader's own state (torchdata's StatefulDataLoader).

        ``fabric.save`` gathers the states of all ranks into the checkpoint, so that each rank gets its own back.
        """
        from fabric.utilities import _loader_state

        if not _loader_state.is_stateful(self._dataloader):
            raise _loader_state.unsupported(self._dataloader)
        mid_epoch, batches, unused = self._position()
        state: dict[str, Any] = {
            # Inside an epoch: the epoch being read. At a boundary: the epoch the next iteration starts.
            "epoch": self._epoch - 1 if mid_epoch else self._epoch,
            "mid_epoch": mid_epoch,
            "batches": batches if mid_epoch else 0,
            "fingerprint": _loader_state.fingerprint(self._dataloader),
            "loader": _loader_state.inner_state(self._dataloader, batches, unused) if mid_epoch else None,
            "generator": None if mid_epoch else _sampler_generator_state(self._dataloader),
            # A shuffling sampler without a generator draws every later epoch from torch's global RNG, as in PyTorch.
            "global_rng": torch.get_rng_state() if _loader_state.draws_from_global_rng(self._dataloader) else None,
        }
        return _loader_state.entry({str(self._rank): state}, self._world_size)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a saved position: the next iteration resumes the saved epoch after its last batch."""
        from fabric.utilities import _loader_state

        if not _loader_state.is_stateful(self._dataloader):
            _loader_state.load_without_position(self._dataloader, state_dict)
            return
        state = _loader_state.rank_state(state_dict, self._rank, self._world_size)
        # Across world sizes the sampler may differ (a RandomSampler on one process, a seeded DistributedSampler on
        # more): both shuffle, but only one has a seed. Only an epoch boundary gets this far (see rank_state).
        changed = state_dict["world_size"] != self._world_size
        ignore = ("seed",) if changed else ()
        _loader_state.check_fingerprint(state["fingerprint"], _loader_state.fingerprint(self._dataloader), ignore)
        self._epoch = state["epoch"]
        self._current = None
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


def _asked_past_the_end(iterator: Any) -> bool:
    """Whether the loop asked for a batch after the epoch's last one (so it is done with every batch)."""
    if getattr(iterator, "_finished", False):  # torchdata's iterators
        return True
    if getattr(iterator, "_num_workers", 0) == 0:  # torch's, in this process: its batch sampler ran out when asked
        return getattr(getattr(iterator, "_sampler_iter", None), "exhausted", False)
    return getattr(iterator, "_shutdown", False)  # torch's with workers (never persistent here): shut down at the end


def _start(dataloader: DataLoader, freeze_gc: bool) -> Iterator[Any]:
    """iter(dataloader); with freeze_gc, under gc.freeze() when that starts worker processes by forking."""
    if not freeze_gc or not _forks_workers(dataloader):
        return iter(dataloader)
    import gc

    if gc.get_freeze_count():  # the program froze its heap itself: leave the collector to it
        return iter(dataloader)
    # A forked worker that collects garbage touches every object the parent had tracked, and so copies most of
    # the parent's heap page by page (~100 ms per epoch start). Frozen objects are never scanned, in the workers
    # either; the parent unfreezes them at once, so its own collections are as before.
    gc.freeze()
    try:
        return iter(dataloader)
    finally:
        gc.unfreeze()


def _forks_workers(dataloader: DataLoader) -> bool:
    """Whether iterating starts worker processes with the fork start method."""
    if dataloader.num_workers == 0:
        return False
    import multiprocessing

    context = dataloader.multiprocessing_context
    if context is None:  # the default, read without fixing it (get_start_method() would)
        method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    else:
        method = context.get_start_method() if hasattr(context, "get_start_method") else str(context)
    return method == "fork"


class _StepWatch:
    """Tells the loaders of one Fabric when an optimizer it set up has stepped (torch's step post-hook).

    A loader counts the batch it gave out last only once a step has followed it, so that a save made before the
    step (a preemption check at the top of the loop body) resumes with that batch. One Python call per step.
    """

    def __init__(self, optimizers: Callable[[], list[Any]]) -> None:
        self._optimizers = optimizers  # the optimizers set up so far, read again at each epoch start
        self._hooked: dict[int, Any] = {}  # id(optimizer) -> (weak reference, hook handle)
        self._loaders: list[weakref.ref[_FabricDataLoader]] = []

    @property
    def active(self) -> bool:
        """Whether an optimizer is watched: only then does a step say that a batch was used."""
        return any(ref() is not None for ref, _ in self._hooked.values())

    def add_loader(self, loader: _FabricDataLoader) -> None:
        """Tell this loader about every later step."""
        self._loaders = [ref for ref in self._loaders if ref() is not None]
        self._loaders.append(weakref.ref(loader))
        self.attach()

    def attach(self) -> None:
        """Hook every optimizer set up so far that is not hooked yet."""
        for optimizer in self._optimizers():
            known = self._hooked.get(id(optimizer))
            register = getattr(optimizer, "register_step_post_hook", None)  # torch optimizers have it
            if callable(register) and (known is None or known[0]() is not optimizer):
                handle = register(self._stepped)
                self._hooked[id(optimizer)] = (weakref.ref(optimizer), handle)

    def _stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for ref in self._loaders:
            loader = ref()
            if loader is not None:
                loader._on_step()

"""Rebuild DataLoaders with a distributed sampler or a seeded worker_init_fn, without patching DataLoader."""

from __future__ import annotations

import contextlib
import functools
import inspect
import random
import sys
from collections.abc import Collection, Iterator, Sized
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from fabric.utilities.exceptions import FabricTypeError
from fabric.utilities.seed import worker_init_function

_T = TypeVar("_T")

# Read from the installed torch so that arguments added or removed between versions are handled.
_DATALOADER_PARAMS: tuple[str, ...] = tuple(
    name for name in inspect.signature(DataLoader.__init__).parameters if name not in ("self", "shuffle")
)
_DISTRIBUTED_REMEDY = "pass use_distributed_sampler=False and give the loader a DistributedSampler yourself"


def has_iterable_dataset(dataloader: DataLoader) -> bool:
    """Whether the loader reads from an IterableDataset, which takes no sampler."""
    return isinstance(getattr(dataloader, "dataset", None), IterableDataset)


def is_distributed_sampler(sampler: object) -> bool:
    """Whether the sampler already yields only this rank's share of the indices."""
    # DistributedSamplerWrapper subclasses DistributedSampler, so one check covers both.
    return isinstance(sampler, DistributedSampler)


@contextlib.contextmanager
def _seeded_global_rngs(seed: int) -> Iterator[None]:
    """Seed torch's, ``random``'s and (if already imported) numpy's global RNGs, restoring them afterwards."""
    numpy = sys.modules.get("numpy")  # a sampler that uses numpy has imported it already
    python_state = random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        if numpy is not None:
            numpy.random.seed(seed % 2**32)  # numpy accepts 32-bit seeds only
        try:
            yield
        finally:
            random.setstate(python_state)
            if numpy is not None:
                numpy.random.set_state(numpy_state)


class DistributedSamplerWrapper(DistributedSampler):
    """Shards the indices of any sampler across ranks, keeping the wrapped sampler's own order.

    Each epoch the wrapped sampler is iterated once and its indices are padded (or, with
    ``drop_last``, truncated) and split exactly as ``DistributedSampler`` splits ``range(len)``.
    The wrapped sampler is iterated with the global RNGs of torch, ``random`` and numpy seeded from
    ``seed + epoch`` (and restored afterwards) so that every rank draws the same indices and the
    shards stay disjoint for random samplers that use them (such as ``WeightedRandomSampler``).
    """

    def __init__(self, sampler: Sampler, num_replicas: int, rank: int, drop_last: bool = False, seed: int = 0) -> None:
        if not isinstance(sampler, Sized):
            raise FabricTypeError(
                f"DistributedSamplerWrapper({type(sampler).__name__}): the sampler has no __len__, so its "
                f"indices cannot be split evenly across {num_replicas} ranks. Give the sampler a __len__, "
                "or pass use_distributed_sampler=False and shard the data yourself."
            )
        # DistributedSampler only needs len() of its dataset; the sampler's length is the index count.
        super().__init__(cast(Dataset, sampler), num_replicas, rank, shuffle=False, seed=seed, drop_last=drop_last)
        self.sampler = sampler

    def __iter__(self) -> Iterator[int]:
        with _seeded_global_rngs(self.seed + self.epoch):
            indices = list(self.sampler)
        if not indices:
            return iter([])
        if self.drop_last:
            indices = indices[: self.total_size]
        else:
            repeats = -(-self.total_size // len(indices))
            indices = (indices * repeats)[: self.total_size]
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch here and on the wrapped sampler, if it tracks epochs too."""
        super().set_epoch(epoch)
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


@dataclass(frozen=True)
class _RebuildContext:
    """Why a loader is being rebuilt, so that a failure can tell the user what to do."""

    caller: str
    purpose: str
    remedy: str

    def error(self, obj: object, what: str, reason: str, fix: str) -> FabricTypeError:
        """Build the error for an object that cannot be re-created."""
        return FabricTypeError(
            f"{self.caller}({type(obj).__name__}): cannot rebuild this {what} {self.purpose} because "
            f"{reason}. {fix}, or {self.remedy}."
        )


def _init_arguments(
    obj: object, params: list[inspect.Parameter], values: dict[str, Any], what: str, ctx: _RebuildContext
) -> tuple[list[Any], dict[str, Any]]:
    """Positional-only and keyword arguments for the named parameters of ``type(obj).__init__``."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for param in params:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue  # *args cannot be recovered from attributes; **kwargs is filled by the caller
        if param.name in values:
            value = values[param.name]
        elif hasattr(obj, param.name):
            value = getattr(obj, param.name)
        elif param.default is param.empty:
            reason = f"its __init__ argument '{param.name}' is not saved as the attribute 'self.{param.name}'"
            raise ctx.error(obj, what, reason, f"Save it as 'self.{param.name}' in __init__")
        elif param.kind is param.POSITIONAL_ONLY:
            value = param.default  # later positional-only arguments need this slot filled
        else:
            continue
        if param.kind is param.POSITIONAL_ONLY:
            args.append(value)
        else:
            kwargs[param.name] = value
    return args, kwargs


def _reinstantiate(obj: _T, what: str, values: dict[str, Any], must_pass: Collection[str], ctx: _RebuildContext) -> _T:
    """Create a new ``type(obj)``, each ``__init__`` argument taken from ``values``, else from ``obj``.

    Optional arguments found in neither keep their default. ``values`` not named in the
    signature go through ``**kwargs`` when ``__init__`` accepts them.
    """
    cls = type(obj)
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]  # drop self
    args, kwargs = _init_arguments(obj, params, values, what, ctx)
    named = {param.name for param in params if param.kind is not param.VAR_KEYWORD}
    accepts_kwargs = len(named) < len(params)
    for name in must_pass:
        if name not in named and not accepts_kwargs:
            reason = f"its __init__ takes neither a '{name}' argument nor **kwargs"
            fix = f"Accept '{name}' in __init__ and pass it on to the parent class"
            raise ctx.error(obj, what, reason, fix)
    if accepts_kwargs:
        kwargs.update({name: value for name, value in values.items() if name not in named})
    return cls(*args, **kwargs)


def _sampling_values(dataloader: DataLoader, sampler: Sampler | None, ctx: _RebuildContext) -> dict[str, Any]:
    """The DataLoader arguments that decide sampling and batching; ``sampler`` replaces the current one."""
    if has_iterable_dataset(dataloader):
        return {
            "sampler": None,
            "batch_sampler": None,
            "batch_size": dataloader.batch_size,
            "drop_last": dataloader.drop_last,
        }
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is None:  # batch_size=None: the loader yields single samples
        new = dataloader.sampler if sampler is None else sampler
        return {"sampler": new, "batch_sampler": None, "batch_size": None, "drop_last": False}
    if type(batch_sampler) is BatchSampler:
        # Unpacked so that the rebuilt loader reports batch_size and drop_last like the original.
        new = batch_sampler.sampler if sampler is None else sampler
        return {
            "sampler": new,
            "batch_sampler": None,
            "batch_size": batch_sampler.batch_size,
            "drop_last": batch_sampler.drop_last,
        }
    if sampler is not None:
        values = {"sampler": sampler}
        batch_sampler = _reinstantiate(batch_sampler, "batch sampler", values, ("sampler",), ctx)
    return {"sampler": None, "batch_sampler": batch_sampler, "batch_size": 1, "drop_last": False}


def _rebuild_dataloader(
    dataloader: DataLoader, sampler: Sampler | None, overrides: dict[str, Any], ctx: _RebuildContext
) -> DataLoader:
    """Re-create the loader from its constructor arguments, read back from its attributes."""
    values = {name: getattr(dataloader, name) for name in _DATALOADER_PARAMS if hasattr(dataloader, name)}
    values.update(_sampling_values(dataloader, sampler, ctx))
    # The order now lives in the sampler; shuffle=True next to a sampler is rejected by DataLoader.
    values["shuffle"] = False
    values.update(overrides)
    must_pass = list(overrides)
    if sampler is not None:  # a subclass that cannot take the new sampler would silently keep the old one
        must_pass.append("sampler" if values["batch_sampler"] is None else "batch_sampler")
    return _reinstantiate(dataloader, "DataLoader subclass", values, must_pass, ctx)


def _active_sampler(dataloader: DataLoader, ctx: _RebuildContext) -> Any:
    """The sampler whose indices the loader actually uses."""
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is None:
        return dataloader.sampler
    if not hasattr(batch_sampler, "sampler"):
        raise ctx.error(
            batch_sampler,
            "batch sampler",
            "it does not save the sampler it draws indices from as the attribute 'self.sampler'",
            "Accept the sampler as the __init__ argument 'sampler' and save it as 'self.sampler'",
        )
    return batch_sampler.sampler


def _to_distributed(sampler: Sampler, num_replicas: int, rank: int, seed: int) -> DistributedSampler:
    """The distributed sampler that gives this rank its share of ``sampler``'s indices."""
    # Exact types only: a subclass may change the order, which only the wrapper keeps.
    if type(sampler) is RandomSampler:
        dataset = cast(Dataset, sampler.data_source)
        if not sampler.replacement and sampler.num_samples == len(sampler.data_source):
            return DistributedSampler(dataset, num_replicas, rank, shuffle=True, seed=seed)
    if type(sampler) is SequentialSampler:
        dataset = cast(Dataset, sampler.data_source)
        return DistributedSampler(dataset, num_replicas, rank, shuffle=False)
    return DistributedSamplerWrapper(sampler, num_replicas, rank, seed=seed)


def inject_distributed_sampler(
    dataloader: DataLoader, num_replicas: int, rank: int, seed: int = 0, caller: str = "setup_dataloaders"
) -> DataLoader:
    """Return a loader that reads only this rank's share of the data.

    A ``RandomSampler`` becomes ``DistributedSampler(shuffle=True, seed=seed)``, a
    ``SequentialSampler`` becomes ``DistributedSampler(shuffle=False)``, and any other sampler is
    wrapped in ``DistributedSamplerWrapper``. Loaders over an IterableDataset, or whose sampler is
    already distributed, are returned untouched.

    The loader is re-created from its constructor arguments, read back from same-named attributes.
    For a DataLoader subclass every ``__init__`` argument is read that way; an optional argument
    without such an attribute keeps its default, and a required one raises ``TypeError``. A custom
    batch sampler is re-created the same way, with its ``sampler`` argument replaced.
    """
    if has_iterable_dataset(dataloader):
        return dataloader
    batch_sampler_sampler = getattr(dataloader.batch_sampler, "sampler", None)
    if is_distributed_sampler(dataloader.sampler) or is_distributed_sampler(batch_sampler_sampler):
        return dataloader
    ctx = _RebuildContext(caller, "with a distributed sampler", _DISTRIBUTED_REMEDY)
    sampler = _to_distributed(_active_sampler(dataloader, ctx), num_replicas, rank, seed)
    return _rebuild_dataloader(dataloader, sampler, {}, ctx)


def add_worker_init_fn(dataloader: DataLoader, rank: int) -> DataLoader:
    """Return a loader whose workers are seeded by ``worker_init_function`` (as Lightning Fabric seeds them).

    Loaders without worker processes, or with a ``worker_init_fn`` of their own, are returned as is.
    """
    if dataloader.num_workers == 0 or dataloader.worker_init_fn is not None:
        return dataloader
    ctx = _RebuildContext(
        "setup_dataloaders", "to add a seeded worker_init_fn", "give the loader a worker_init_fn yourself"
    )
    init_fn = functools.partial(worker_init_function, rank=rank)
    return _rebuild_dataloader(dataloader, None, {"worker_init_fn": init_fn}, ctx)


# -- Lightning Fabric's public data helpers (fabric.utilities.data.*) ------------------------------------


def sized_len(dataloader: object) -> int | None:
    """``len(dataloader)``, or None when it has no length (an IterableDataset without ``__len__``)."""
    try:
        return len(dataloader)  # type: ignore[arg-type]
    except (TypeError, NotImplementedError):
        return None


def has_len(dataloader: object) -> bool:
    """Whether ``len(dataloader)`` works; warns when it is 0, or when an IterableDataset defines it."""
    from fabric.utilities.rank_zero import rank_zero_warn

    length = sized_len(dataloader)
    if length == 0:
        rank_zero_warn(
            f"has_len: the {type(dataloader).__name__} has length 0, so a loop over it does nothing.", stacklevel=5
        )
    if length is not None and has_iterable_dataset(dataloader):  # type: ignore[arg-type]
        # Each worker process iterates the whole IterableDataset, so the length is per worker at best.
        rank_zero_warn(
            f"has_len: the {type(dataloader).__name__} reads an IterableDataset that defines __len__; with "
            "several workers each one yields the whole dataset unless it shards by worker itself, so the "
            "length may not match what the loop sees.",
            stacklevel=5,  # the line that called has_len
        )
    return length is not None


def suggested_max_num_workers(local_world_size: int) -> int:
    """An upper bound for a DataLoader's ``num_workers``: this process's share of the usable CPU cores, minus one.

    ``local_world_size`` is the number of processes on this machine (``Fabric(devices=...)``). At least 1.
    """
    import os

    from fabric.utilities.exceptions import FabricValueError

    if local_world_size < 1:
        raise FabricValueError(
            f"suggested_max_num_workers(local_world_size={local_world_size}): at least one process runs on this "
            "machine. Pass the number of processes per machine (the devices flag), 1 or more."
        )
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // local_world_size - 1)  # one core stays with the process that trains


class AttributeDict(dict):
    """A dict whose keys are also attributes: ``state.step += 1`` is ``state["step"] += 1``.

    Handy for the ``state`` passed to ``fabric.save`` and ``fabric.load``; it pickles like a dict.
    """

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{key}'") from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def __delattr__(self, key: str) -> None:
        del self[key]

    def __repr__(self) -> str:
        if not self:
            return ""
        width = max(len(str(key)) for key in self) + 3  # the key, its two quotes and the colon
        labels = {key: f'"{key}":' for key in self}
        return "\n".join(f"{labels[key]:<{width}} {self[key]}" for key in sorted(self))


def _set_sampler_epoch(dataloader: object, epoch: int) -> None:
    """Call ``set_epoch(epoch)`` on the loader's sampler and its batch sampler's sampler (each object once).

    A ``DistributedSampler`` reshuffles only when told the epoch; forgetting it repeats epoch 0's order.
    """
    candidates = [getattr(dataloader, "sampler", None)]
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    if batch_sampler is not None:
        candidates.append(getattr(batch_sampler, "sampler", None))
    unique = {id(obj): obj for obj in candidates if obj is not None}
    for obj in unique.values():
        set_epoch = getattr(obj, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

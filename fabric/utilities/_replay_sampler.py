"""A random sampler that can repeat an interrupted epoch: torch's own sampler, plus the RNG state its epoch began from.

torch's RandomSampler (and WeightedRandomSampler, SubsetRandomSampler) draws each epoch's order from torch's global
RNG or from the generator it was given, when its iteration starts. Wrapping it keeps that order exactly (the same
seed gives the same batches as plain PyTorch and Lightning Fabric); the wrapper only records the RNG state just
before the draw, so that a resumed run can draw the same order again and skip the indices already used.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, Sampler


class _ReplaySampler(Sampler[int]):
    """Iterates the wrapped sampler; its iterators report and restore their position (torchdata's Stateful)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    @property
    def generator(self) -> torch.Generator | None:
        """The wrapped sampler's own generator; None when it draws from torch's global RNG."""
        return getattr(self.sampler, "generator", None)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[int]:
        return _ReplayIterator(self.sampler)


class _ReplayIterator(Iterator[int]):
    """One epoch of the wrapped sampler, with the RNG state it started from and how many indices it gave."""

    def __init__(self, sampler: Any) -> None:
        self._sampler = sampler
        self._inner: Iterator[int] | None = None
        self._start: torch.Tensor | None = None
        self._yielded = 0

    def __next__(self) -> int:
        if self._inner is None:
            # The wrapped sampler draws when its first index is asked for: record the state it draws from.
            generator = self._sampler.generator
            self._start = torch.get_rng_state() if generator is None else generator.get_state()
            self._inner = iter(self._sampler)
        value = next(self._inner)
        self._yielded += 1
        return value

    def state_dict(self) -> dict[str, Any]:
        """The RNG state the epoch began from (None before its first index) and the indices given so far."""
        return {"start": self._start, "yielded": self._yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Draw the saved epoch's order again and skip the indices already given, reading no data."""
        self._start, self._yielded, self._inner = state["start"], state["yielded"], None
        if self._start is None:
            return
        inner = _replay(self._sampler, self._start)
        self._inner = itertools.islice(inner, self._yielded, None)


class _ResumableBatchSampler(BatchSampler):
    """torch's BatchSampler (same batches), whose iterators report and restore their position at no cost per batch.

    torchdata's own BatchSampler counts every index in Python (about 0.1 us each); this one cuts batches with
    ``itertools.islice`` as torch does and counts batches only. The position is asked for by a save, not kept.
    """

    def __iter__(self) -> Iterator[list[int]]:
        return _BatchIterator(self.sampler, self.batch_size, self.drop_last)


class _BatchIterator(Iterator[list[int]]):
    """One epoch of batches: the RNG state the sampler drew its order from, and how many batches were cut."""

    def __init__(self, sampler: Any, batch_size: int, drop_last: bool) -> None:
        self._sampler = sampler
        self._batch_size = batch_size
        self._drop_last = drop_last
        self._indices: Iterator[int] | None = None
        self._start: torch.Tensor | None = None
        self.batches = 0
        self.exhausted = False  # asked for a batch after the last one

    def __next__(self) -> list[int]:
        indices = self._indices
        if indices is None:
            # As in torch's BatchSampler, the sampler draws its order when the first batch is asked for.
            indices = self._indices = self._begin()
        batch = [*itertools.islice(indices, self._batch_size)]
        if not batch or (self._drop_last and len(batch) < self._batch_size):
            self.exhausted = True
            raise StopIteration
        self.batches += 1
        return batch

    def _begin(self) -> Iterator[int]:
        sampler = self._sampler
        if isinstance(sampler, _ReplaySampler):  # its iterator would cost a Python call per index: bypass it
            generator = sampler.generator
            self._start = torch.get_rng_state() if generator is None else generator.get_state()
            return iter(sampler.sampler)
        return iter(sampler)

    def state_dict(self) -> dict[str, Any]:
        """The RNG state a random sampler drew the epoch from (None otherwise) and the batches cut so far."""
        return {"start": self._start, "batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Draw the saved epoch's order again and skip the batches already cut, reading no data."""
        if "samples_yielded" in state:  # saved by torchdata's BatchSampler (fabric before it computed positions)
            inner_state = state.get("sampler_iter_state") or {}
            state = {"start": inner_state.get("start"), "batches": state["samples_yielded"] // self._batch_size}
        self._start, self.batches = state["start"], state["batches"]
        skip = self.batches * self._batch_size
        sampler = self._sampler
        if isinstance(sampler, _ReplaySampler):
            if self._start is None:  # saved before the epoch drew its order: it draws when the next batch is asked
                self._indices = None
                return
            inner = _replay(sampler.sampler, self._start)
        else:
            inner = iter(sampler)
        self._indices = itertools.islice(inner, skip, None)


def _replay(sampler: Any, start: torch.Tensor) -> Iterator[int]:
    """The order `sampler` drew from the RNG state `start` (its generator's, or torch's global one)."""
    generator = sampler.generator
    if generator is not None:
        generator.set_state(start)  # the user's generator goes on from there, as it did in the saved run
        return iter(sampler)
    # Replay the draw from the saved global state, then give the global RNG back its current state.
    current = torch.get_rng_state()
    torch.set_rng_state(start)
    try:
        inner = iter(sampler)
        first = list(itertools.islice(inner, 1))
    finally:
        torch.set_rng_state(current)
    return itertools.chain(first, inner)

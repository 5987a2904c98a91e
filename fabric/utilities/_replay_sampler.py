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
from torch.utils.data import Sampler


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
        generator = self._sampler.generator
        if generator is not None:
            generator.set_state(self._start)  # the user's generator goes on from there, as it did in the saved run
            inner: Iterator[int] = iter(self._sampler)
        else:
            # Replay the draw from the saved global state, then give the global RNG back its current state.
            current = torch.get_rng_state()
            torch.set_rng_state(self._start)
            try:
                inner = iter(self._sampler)
                first = list(itertools.islice(inner, 1))
            finally:
                torch.set_rng_state(current)
            inner = itertools.chain(first, inner)
        self._inner = itertools.islice(inner, self._yielded, None)

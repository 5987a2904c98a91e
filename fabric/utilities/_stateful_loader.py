"""torchdata's StatefulDataLoader at the cost of a plain DataLoader: the position is computed when a save asks for it.

torchdata keeps a loader's position as it goes: a Python call per index in its batch sampler, a snapshot of the
sampler and of every worker after each batch, and at each epoch start a round trip to every worker before the first
index is sent (+6 ms with 2 workers). For the common loader (a map-style dataset without state of its own, batched
from a sampler without state of its own) none of that is needed: the position inside an epoch is the number of
batches taken, the RNG state the sampler drew its order from, and the seeds of the workers. This loader iterates
with torch's own iterators (torchdata's, without snapshots, for persistent workers) and, when a save asks, writes
that position in torchdata's format, so that ``load_state_dict`` (torchdata's) resumes it, fast-forwarding the
sampler without reading a sample.

Any other loader (an IterableDataset, a dataset or sampler with ``state_dict``) keeps torchdata's behaviour.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset, IterableDataset
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter, _SingleProcessDataLoaderIter
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.incremental_state import _DATASET_STATE, _FETCHER_STATE, _WORKER_ID
from torchdata.stateful_dataloader.sampler import BatchSampler as _TorchdataBatchSampler
from torchdata.stateful_dataloader.stateful import Stateful
from torchdata.stateful_dataloader.stateful_dataloader import (
    _INDEX_SAMPLER_STATE,
    _ITERABLEDATASET_LEN_CALLED,
    _ITERATOR_FINISHED,
    _SAMPLER_ITER_STATE,
    _SAMPLER_ITER_YIELDED,
    _SHARED_SEED,
    _StatefulMultiProcessingDataLoaderIter,
    _StatefulSingleProcessDataLoaderIter,
)

from fabric.utilities._replay_sampler import _BatchIterator, _ResumableBatchSampler

_MP = _StatefulMultiProcessingDataLoaderIter
_SP_NUM_YIELDED = _StatefulSingleProcessDataLoaderIter._NUM_YIELDED


def _plain_position(dataset: Dataset, batch_sampler: Any, in_order: bool) -> bool:
    """Whether the whole position is (batches taken, the sampler's start, the worker seeds): see the module doc."""
    return (
        not isinstance(dataset, IterableDataset)
        and not isinstance(dataset, Stateful)
        and isinstance(batch_sampler, _ResumableBatchSampler)
        and in_order
    )


class _FabricStatefulDataLoader(StatefulDataLoader):
    """A StatefulDataLoader that computes its position on demand where it can (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        sampler = self.batch_sampler
        if type(sampler) is _TorchdataBatchSampler and not isinstance(sampler.sampler, Stateful):
            # The same batches from the same sampler, cut without a Python call per index. DataLoader forbids
            # setting batch_sampler after __init__ only to keep it consistent with batch_size and drop_last,
            # which stay as they are here.
            resumable = _ResumableBatchSampler(sampler.sampler, sampler.batch_size, sampler.drop_last)
            object.__setattr__(self, "batch_sampler", resumable)
        self._on_demand = _plain_position(self.dataset, self.batch_sampler, self.in_order)
        if self._on_demand:
            self.snapshot_every_n_steps = 0  # torchdata's per-batch snapshots: position_state replaces them
        # torch's own iterators, except for persistent workers: torchdata's then tells when the loop asked past the
        # end, and its epoch start costs what torch's does (both wait for every worker to resume).
        self._plain = self._on_demand and not (self.persistent_workers and self.num_workers > 0)
        self._current: Any = None  # the iterator of the latest epoch, which a save reads

    def _get_iterator(self) -> Any:
        if not self._plain or self.next_iter_state is not None:
            iterator = super()._get_iterator()  # resuming: torchdata restores the position
        elif self.num_workers == 0:
            iterator = _SingleProcessDataLoaderIter(self)
        else:
            self.check_worker_number_rationality()
            iterator = _MultiProcessingDataLoaderIter(self)
        self._current = iterator
        return iterator

    def __iter__(self) -> Any:
        if not self._plain:
            return super().__iter__()
        # torch's DataLoader.__iter__ (torchdata's reads a `_finished` flag that torch's iterators do not have).
        state: Any = self  # torchdata leaves these attributes unannotated
        if state._initial_iter_for_state_dict:
            state._initial_iter_for_state_dict = False
            return state._iterator
        state._iterator = self._get_iterator()
        return state._iterator

    def position_state(self, batches: int) -> dict[str, Any] | None:
        """torchdata's state after `batches` batches of the current epoch, or None where only torchdata knows it."""
        iterator = self._current
        if not self._on_demand or iterator is None or not isinstance(iterator._sampler_iter, _BatchIterator):
            return None
        position = {**iterator._sampler_iter.state_dict(), "batches": batches}
        main = {
            _INDEX_SAMPLER_STATE: None,
            _SAMPLER_ITER_STATE: position,
            _SAMPLER_ITER_YIELDED: batches,
            _ITERABLEDATASET_LEN_CALLED: iterator._IterableDataset_len_called,
            _SHARED_SEED: iterator._shared_seed,
        }
        if self.num_workers == 0:
            state = {**main, _SP_NUM_YIELDED: batches, _FETCHER_STATE: None, _DATASET_STATE: None}
            return {**state, _ITERATOR_FINISHED: False}
        workers = {
            f"worker_{i}": {_WORKER_ID: i, _FETCHER_STATE: None, _DATASET_STATE: None} for i in range(self.num_workers)
        }
        snapshot = {
            _MP._SNAPSHOT_STEP: batches,
            # Batches go to the workers in turn from worker 0 (in_order, no worker runs out of a map-style dataset).
            _MP._LAST_YIELDED_WORKER_ID: (batches - 1) % self.num_workers,
            _MP._MAIN_SNAPSHOT: {**main, _MP._NUM_WORKERS: self.num_workers, _MP._BASE_SEED: iterator._base_seed},
            _MP._WORKER_SNAPSHOTS: workers,
        }
        return {_MP._SNAPSHOT: snapshot, _MP._STEPS_SINCE_SNAPSHOT: 0, _ITERATOR_FINISHED: False}

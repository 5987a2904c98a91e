"""Point-in-time copies of checkpoint dictionaries for background saves: tensors to (pinned) CPU memory."""

from __future__ import annotations

import copy
import ctypes
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from fabric.io import _buffers
from fabric.utilities.exceptions import FabricTypeError

# Values that cannot change after the snapshot, so they are kept as they are.
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, range)
_StorageKey = tuple[str, int, int]  # (device, data pointer, bytes) of a source storage
_SpareKey = tuple[bool, int]  # (pinned, bytes) of a reserved buffer not yet used by a snapshot
# Buffers from this size on get their own mapping that fork() leaves out (see _buffers); smaller ones are
# ordinary memory, whose copy in a child costs next to nothing.
_MAPPED_FROM = 1 << 20
# CPU copies are split into pieces of this size over up to torch.get_num_threads() threads (at most _MAX_THREADS):
# the loop is blocked during the copy anyway, so its intra-op threads are idle. memmove releases the GIL. On the
# first save each thread also faults in the fresh pages of its own pieces, so faulting runs in parallel too.
_PIECE = 32 << 20
_MAX_THREADS = 8


class BufferPool:
    """CPU storages of the previous snapshot, reused by the next one when the same source storage comes back.

    Allocating (and, with CUDA, pinning) hundreds of MB on every save costs more than copying into memory
    that is already mapped; the caller guarantees the previous snapshot was written before the next is taken.
    `reserve` makes the buffers of a first snapshot ahead of time, in a background thread (see its docstring).
    """

    def __init__(self) -> None:
        self._buffers: dict[_StorageKey, torch.UntypedStorage] = {}
        # Reserved buffers, faulted in, that the next snapshot takes by size before allocating any.
        self._spare: dict[_SpareKey, list[torch.UntypedStorage]] = {}
        # The reserving thread and the list it fills; read only after joining it (no lock a fork could inherit).
        self._reserving: tuple[threading.Thread, list[tuple[_SpareKey, torch.UntypedStorage]]] | None = None
        self._pid = os.getpid()

    @property
    def nbytes(self) -> int:
        """Bytes held for reuse, reserved buffers included once their reservation has been collected."""
        spare = sum(buffer.nbytes() for buffers in self._spare.values() for buffer in buffers)
        return spare + sum(buffer.nbytes() for buffer in self._buffers.values())

    def clear(self) -> None:
        """Free the held memory (after the reservation in progress, if any, has ended)."""
        self._collect_reservation()
        self._buffers, self._spare = {}, {}

    def reserve(self, state: Any) -> int:
        """Start making the buffers a snapshot of `state` will need and does not hold yet; returns their bytes.

        One daemon thread allocates them and faults their pages in, then ends; 0 means nothing to do, or a
        reservation still runs (at most one at a time). The next snapshot waits for it, then takes the reserved
        buffers by size; what it does not use is freed. Only storages of 1 MiB and more on the CPU or CUDA are
        reserved: there the first copy would fault in fresh memory (or pin it).
        """
        self._forget_after_fork()
        if self._reserving is not None and self._reserving[0].is_alive():
            return 0
        self._collect_reservation()
        available = {key: len(buffers) for key, buffers in self._spare.items()}
        wanted = []
        for key, spare_key in storages_to_copy(state).items():
            if key in self._buffers or spare_key[1] < _MAPPED_FROM:
                continue
            if available.get(spare_key, 0) > 0:
                available[spare_key] -= 1
            else:
                wanted.append(spare_key)
        if not wanted:
            return 0
        made: list[tuple[_SpareKey, torch.UntypedStorage]] = []
        thread = threading.Thread(target=_make_buffers, args=(wanted, made), name="fabric-reserve", daemon=True)
        self._reserving = (thread, made)
        thread.start()
        return sum(nbytes for _, nbytes in wanted)

    def snapshot(self, checkpoint: Any) -> Any:
        """A copy of `checkpoint` that later changes to the user's tensors and containers do not affect."""
        self._forget_after_fork()
        self._collect_reservation()
        taker = _Snapshot(self._buffers, self._spare)
        result = taker.copy(checkpoint, "checkpoint")
        taker.finish()
        # Keep only what this snapshot used: storages that disappeared from the state free their copy, and
        # reserved buffers it did not take are freed too.
        self._buffers, self._spare = taker.used, {}
        return result

    def _forget_after_fork(self) -> None:
        if os.getpid() != self._pid:
            # A forked child: the mapped buffers are not mapped here, and the reserving thread does not exist
            # here. Forget them without touching them.
            self._buffers, self._spare, self._reserving, self._pid = {}, {}, None, os.getpid()

    def _collect_reservation(self) -> None:
        """Wait for the reserving thread, then move what it made into the spare buffers."""
        if self._reserving is None or os.getpid() != self._pid:
            return
        thread, made = self._reserving
        thread.join()
        self._reserving = None
        for spare_key, buffer in made:
            self._spare.setdefault(spare_key, []).append(buffer)


def storages_to_copy(state: Any) -> dict[_StorageKey, _SpareKey]:
    """The storages a snapshot of `state` copies into pooled buffers, as the buffers they need.

    Objects with a `state_dict()` (modules, optimizers) count as that state dict, as a save converts them.
    """
    found: dict[_StorageKey, _SpareKey] = {}
    pending: list[Any] = [state]
    seen: dict[int, Any] = {}  # holds what it saw: a state dict freed early could pass its id on to the next
    while pending:
        value = pending.pop()
        if isinstance(value, _IMMUTABLE) or id(value) in seen:
            continue
        seen[id(value)] = value
        if isinstance(value, Tensor):
            if _plain(value) and value.device.type in ("cpu", "cuda"):
                storage = value.untyped_storage()
                key = (str(value.device), storage.data_ptr(), storage.nbytes())
                found[key] = (value.device.type == "cuda", storage.nbytes())
        elif isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
        elif callable(getattr(value, "state_dict", None)):
            pending.append(value.state_dict())
    return found


def _make_buffers(wanted: list[_SpareKey], made: list[tuple[_SpareKey, torch.UntypedStorage]]) -> None:
    """In the reserving thread: allocate and fault in each buffer. Best effort: a save allocates what is missing
    (and reports a failure to allocate itself)."""
    try:
        for pinned, nbytes in wanted:
            buffer = _cpu_buffer(nbytes, pinned)
            if not pinned:  # pinned memory is resident once allocated
                _buffers.fault_in(buffer)
            made.append(((pinned, nbytes), buffer))
    except Exception:  # out of memory here: the save itself allocates and raises what it must
        pass


class _Snapshot:
    def __init__(
        self, previous: dict[_StorageKey, torch.UntypedStorage], spare: dict[_SpareKey, list[torch.UntypedStorage]]
    ) -> None:
        self.previous = previous
        self.spare = spare
        self.used: dict[_StorageKey, torch.UntypedStorage] = {}
        self.memo: dict[int, Any] = {}
        self.devices: set[torch.device] = set()
        # (destination, source, bytes, fresh), done by finish(); `fresh`: a new mapping whose pages are not faulted in
        self.host_copies: list[tuple[int, int, int, bool]] = []

    def copy(self, value: Any, where: str) -> Any:
        if isinstance(value, _IMMUTABLE):
            return value
        if id(value) in self.memo:  # shared objects stay shared, as torch.save would store them
            return self.memo[id(value)]
        result: Any
        if isinstance(value, Tensor):
            result = self._tensor(value)
        elif type(value) is dict:
            result = {key: self.copy(item, f"{where}[{key!r}]") for key, item in value.items()}
        elif isinstance(value, OrderedDict):
            # Module state dicts carry `_metadata` (versions that load_state_dict reads); copy.copy keeps it.
            result = copy.copy(value)
            for key, item in value.items():
                result[key] = self.copy(item, f"{where}[{key!r}]")
        elif type(value) is list:
            result = [self.copy(item, f"{where}[{i}]") for i, item in enumerate(value)]
        elif type(value) is tuple:
            result = tuple(self.copy(item, f"{where}[{i}]") for i, item in enumerate(value))
        else:
            result = self._deepcopy(value, where)
        self.memo[id(value)] = result
        return result

    def _deepcopy(self, value: Any, where: str) -> Any:
        try:
            return copy.deepcopy(value)
        except Exception as err:
            raise FabricTypeError(
                f"save(): {where} is a {type(value).__name__} that cannot be copied ({type(err).__name__}: {err}), "
                "and a background save must copy the state before returning. Store its state (a dict of tensors "
                "and plain values) instead, or save without AsyncCheckpointIO."
            ) from err

    def _tensor(self, tensor: Tensor) -> Tensor:
        if not _plain(tensor):
            # Subclasses (Parameter, DTensor), sparse and quantized tensors: a copy on their own device.
            return copy.deepcopy(tensor) if tensor.is_leaf else tensor.detach().clone()
        storage = tensor.untyped_storage()
        copied = self._storage(storage, tensor.device)
        result = torch.empty(0, dtype=tensor.dtype)
        result.set_(copied, tensor.storage_offset(), tensor.size(), tensor.stride())
        return result.requires_grad_(tensor.requires_grad)

    def _storage(self, storage: torch.UntypedStorage, device: torch.device) -> torch.UntypedStorage:
        """The CPU copy of a whole storage, once per storage: views and tied weights keep sharing it."""
        key = (str(device), storage.data_ptr(), storage.nbytes())
        if key in self.used:
            return self.used[key]
        buffer = self.previous.get(key)
        fresh = False
        if buffer is None:
            pinned = device.type == "cuda"
            reserved = self.spare.get((pinned, storage.nbytes()))
            if reserved:  # made and faulted in by BufferPool.reserve
                buffer = reserved.pop()
            else:
                buffer, fresh = _cpu_buffer(storage.nbytes(), pinned), True
        if device.type == "cpu":
            fresh = fresh and storage.nbytes() >= _MAPPED_FROM and _buffers.dontfork_supported()
            self.host_copies.append((buffer.data_ptr(), storage.data_ptr(), storage.nbytes(), fresh))
        else:
            # Non-blocking device-to-host copies overlap; synchronize() waits for all of them before returning.
            buffer.copy_(storage, non_blocking=buffer.is_pinned())
            self.devices.add(device)
        self.used[key] = buffer
        return buffer

    def finish(self) -> None:
        """Copy the CPU storages and wait for the device copies: the snapshot is complete when save returns."""
        # glibc's memmove streams large copies past the cache: about twice as fast as storage.copy_ here.
        pieces = [
            (dst + offset, src + offset, min(_PIECE, nbytes - offset), fresh)
            for dst, src, nbytes, fresh in self.host_copies
            for offset in range(0, nbytes, _PIECE)
        ]
        threads = min(_MAX_THREADS, torch.get_num_threads(), len(pieces))
        if threads > 1:
            with ThreadPoolExecutor(threads, thread_name_prefix="fabric-snapshot") as pool:
                list(pool.map(_copy_piece, pieces))
        else:
            for piece in pieces:
                _copy_piece(piece)
        for device in self.devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)


def _plain(tensor: Tensor) -> bool:
    """Whether the snapshot copies `tensor` by its storage into a pooled buffer (else: a copy on its device)."""
    return (
        type(tensor) is Tensor
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
        and tensor.device.type != "meta"
    )


def _copy_piece(piece: tuple[int, int, int, bool]) -> None:
    destination, source, nbytes, fresh = piece
    if fresh:  # one call faults the piece in: about half the cost of faulting page by page in memmove
        _buffers.populate(destination, nbytes)
    ctypes.memmove(destination, source, nbytes)


def _cpu_buffer(nbytes: int, pinned: bool) -> torch.UntypedStorage:
    if pinned:  # page-locked memory lets the device copy straight into it, asynchronously
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()
    if nbytes < _MAPPED_FROM or not _buffers.dontfork_supported():
        return torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
    return _buffers.mapped_storage(nbytes)

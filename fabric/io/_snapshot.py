"""Point-in-time copies of checkpoint dictionaries for background saves: tensors to (pinned) CPU memory."""

from __future__ import annotations

import copy
import ctypes
import os
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
    """

    def __init__(self) -> None:
        self._buffers: dict[_StorageKey, torch.UntypedStorage] = {}
        self._pid = os.getpid()

    @property
    def nbytes(self) -> int:
        """Bytes held for reuse."""
        return sum(buffer.nbytes() for buffer in self._buffers.values())

    def clear(self) -> None:
        """Free the held memory."""
        self._buffers = {}

    def snapshot(self, checkpoint: Any) -> Any:
        """A copy of `checkpoint` that later changes to the user's tensors and containers do not affect."""
        if os.getpid() != self._pid:
            # A forked child: the mapped buffers are not mapped here. Forget them without touching them.
            self._buffers, self._pid = {}, os.getpid()
        taker = _Snapshot(self._buffers)
        result = taker.copy(checkpoint, "checkpoint")
        taker.finish()
        # Keep only what this snapshot used: storages that disappeared from the state free their copy.
        self._buffers = taker.used
        return result


class _Snapshot:
    def __init__(self, previous: dict[_StorageKey, torch.UntypedStorage]) -> None:
        self.previous = previous
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
        plain = (
            type(tensor) is Tensor
            and tensor.layout == torch.strided
            and not tensor.is_quantized
            and not tensor.is_conj()
            and not tensor.is_neg()
            and tensor.device.type != "meta"
        )
        if not plain:
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
        fresh = buffer is None
        if buffer is None:
            buffer = _cpu_buffer(storage.nbytes(), pinned=device.type == "cuda")
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

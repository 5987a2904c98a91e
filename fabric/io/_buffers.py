"""CPU memory for snapshots of background saves: anonymous mappings that a fork() leaves out of the child.

The snapshot buffers stay mapped between saves so that later saves only copy. Held like ordinary memory, each
GiB makes every later `fork()` (DataLoader workers, each epoch) copy its page tables: about 200 ms per GiB
instead of 5 ms. Mapped here with MADV_DONTFORK (Linux), a child starts without them; nothing in a child may
read them, so a buffer made by another process is never used or unmapped (`Mapping.usable`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from typing import Any

import torch

# Linux only: elsewhere `dontfork_supported()` is False and the caller uses ordinary memory.
_MADV_DONTFORK = getattr(mmap, "MADV_DONTFORK", None)
# MADV_POPULATE_WRITE (Linux 5.14): fault a range in with one call, about twice as fast as faulting it page by
# page during the copy. Older kernels refuse it (EINVAL) and the copy faults the pages itself.
_MADV_POPULATE_WRITE = 23
_libc: Any = None


def dontfork_supported() -> bool:
    """Whether this platform can map memory that fork() does not copy."""
    return _MADV_DONTFORK is not None and sys.platform.startswith("linux") and _load_libc() is not None


def _load_libc() -> Any:
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_long]  # fmt: skip
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        except (OSError, AttributeError):
            return None
        _libc = libc
    return _libc


class Mapping:
    """One anonymous private mapping, excluded from fork() children; unmapped when the last storage on it goes.

    Unmapping happens only in the process that mapped it: in a forked child the range is not mapped at all
    (another allocation may sit there by then), so a child never touches or unmaps it.
    """

    def __init__(self, nbytes: int) -> None:
        libc = _load_libc()
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        address = libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
        if address is None or address == ctypes.c_void_p(-1).value:
            error = os.strerror(ctypes.get_errno())
            raise MemoryError(f"mmap of {nbytes} bytes for a checkpoint snapshot failed: {error}")
        self.address: int = address
        self.nbytes = nbytes
        self.pid = os.getpid()
        # Held here: at interpreter exit a late __del__ may find the module globals already cleared.
        self._getpid, self._munmap = os.getpid, libc.munmap
        libc.madvise(address, nbytes, _MADV_DONTFORK)

    @property
    def usable(self) -> bool:
        """False in a forked child, where the range is not mapped."""
        return self._getpid() == self.pid

    def __del__(self) -> None:
        if self.usable:
            self._munmap(self.address, self.nbytes)


def mapped_storage(nbytes: int) -> torch.UntypedStorage:
    """A CPU storage of `nbytes` on its own DONTFORK mapping; its pages are faulted in by `populate` or the copy."""
    mapping = Mapping(nbytes)
    view = (ctypes.c_uint8 * nbytes).from_address(mapping.address)
    view._fabric_mapping = mapping  # type: ignore[attr-defined]  # the storage holds `view`, `view` the mapping
    return torch.frombuffer(view, dtype=torch.uint8).untyped_storage()


def populate(address: int, nbytes: int) -> bool:
    """Fault in [address, address + nbytes) of a mapping in one call (page-aligned start); best effort.

    Returns whether the kernel did it; if not, the first write to each page faults it in.
    """
    libc = _load_libc()
    return libc is not None and libc.madvise(address, nbytes, _MADV_POPULATE_WRITE) == 0


def fault_in(storage: torch.UntypedStorage) -> None:
    """Make every page of a fresh buffer resident now, so that a later copy into it faults nothing."""
    if not populate(storage.data_ptr(), storage.nbytes()):
        ctypes.memset(storage.data_ptr(), 0, storage.nbytes())  # older kernels: writing faults each page in

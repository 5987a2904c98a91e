"""Reading torch.distributed.checkpoint (DCP) directories without running code from their pickles.

DCP pickles two things: the `.metadata` file (read with plain `pickle.load`) and non-tensor values (read with
`torch.load(weights_only=False)`). Unless the user passes weights_only=False, both go through restricted
unpicklers here: the metadata may only name DCP's own data classes, the values only what torch's weights-only
unpickler allows.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
from typing import IO, Any

import torch

from fabric.io._load import refused, saved_device_or_cpu, torch_load

# Where the classes in a `.metadata` file live (the dataclasses of DCP's metadata, and the storage info record).
_METADATA_MODULES = frozenset(
    {
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.filesystem",
        "torch.distributed.checkpoint.planner",
    }
)
_OTHER_SAFE = frozenset(
    {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles only DCP metadata records, torch dtypes/sizes and plain containers; anything else is refused."""

    def __init__(self, file: IO[bytes], path: str, op: str) -> None:
        super().__init__(file)
        self._path = path
        self._op = op

    def find_class(self, module: str, name: str) -> Any:
        obj = super().find_class(module, name)
        if (module, name) in _OTHER_SAFE or (module == "torch" and isinstance(obj, torch.dtype)):
            return obj
        is_record = isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
        if module in _METADATA_MODULES and is_record and obj.__module__ == module:
            return obj
        raise refused(self._path, self._op, [f"{module}.{name}"])


def load_metadata(file: IO[bytes] | Any, path: str, op: str, weights_only: bool | None) -> Any:
    """Unpickle a DCP `.metadata` file; only DCP's own records unless `weights_only` is False."""
    if weights_only is False:
        return pickle.load(file)
    return _MetadataUnpickler(file, path, op).load()


def reader(path: str, op: str, weights_only: bool | None) -> Any:
    """A DCP storage reader (FsspecReader for a URL) whose metadata is read through `load_metadata`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.storage import StorageMeta

    from fabric.io import _fsspec

    base = FsspecReader if _fsspec.is_url(path) else FileSystemReader

    class _SafeReader(base):  # type: ignore[valid-type,misc]
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata_path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(metadata_path, "rb") as handle:
                metadata = load_metadata(handle, path, op, weights_only)
            # What torch's own reader does after unpickling: mark the metadata with this load's id.
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeReader(path)


def _safe_bytes(planner: Any, path: str, op: str, weights_only: bool | None) -> Any:
    """Make `planner` unpickle non-tensor values with the weights-only rules (unless weights_only is False)."""
    if weights_only is False:
        return planner
    original = planner.load_bytes

    def load_bytes(read_item: Any, value: io.BytesIO) -> None:
        loaded = torch_load(value, path, op, saved_device_or_cpu, weights_only)
        # Hand the already-safe object on in the form the planner expects: a torch.save stream.
        again = io.BytesIO()
        torch.save(loaded, again)
        again.seek(0)
        original(read_item, again)

    planner.load_bytes = load_bytes
    return planner


def load_planner(strict: bool, path: str, op: str, weights_only: bool | None, base: Any = None) -> Any:
    """DCP's default load planner (partial loads allowed unless strict), or `base`, with safe non-tensor values."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    planner = base if base is not None else DefaultLoadPlanner(allow_partial_load=not strict)
    return _safe_bytes(planner, path, op, weights_only)


def entries_planner(keys: set[str] | None, path: str, op: str, weights_only: bool | None) -> Any:
    """The planner that rebuilds whole entries from the metadata, with safe non-tensor values."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    return _safe_bytes(_EmptyStateDictLoadPlanner(keys=keys), path, op, weights_only)

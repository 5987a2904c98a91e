"""Reading torch.distributed.checkpoint (DCP) directories without running code from their pickles.

DCP pickles two things: the `.metadata` file (read with plain `pickle.load`) and non-tensor values (read with
`torch.load(weights_only=False)`). Unless the user passes weights_only=False, both go through restricted
unpicklers here: the metadata may only name DCP's own data classes, the values only what torch's weights-only
unpickler allows.
"""

from __future__ import annotations

import _compat_pickle
import dataclasses
import enum
import importlib
import io
import pickle
import sys
from pathlib import Path
from types import ModuleType
from typing import IO, Any

import torch

from fabric.io._load import refused, saved_device_or_cpu, torch_load
from fabric.utilities.exceptions import FabricValueError

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
    """Unpickles only DCP metadata records, torch dtypes/sizes and plain containers; anything else is refused.

    The decision is made from the two strings the pickle names, before anything is imported: pickle's own
    find_class imports the named module, which runs that module's code whatever the answer would have been.
    """

    def __init__(self, file: IO[bytes], path: str, op: str) -> None:
        super().__init__(file)
        self._path = path
        self._op = op

    def find_class(self, module: str, name: str) -> Any:
        # Protocol 2 pickles name Python 2 modules ('__builtin__', ...); pickle's own find_class maps them so.
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        obj = _allowed(module, name)
        if obj is None:
            raise refused(self._path, self._op, [f"{module}.{name}"])
        return obj


def _allowed(module: str, name: str) -> Any:
    """The object `module`.`name` if the metadata may use it, else None; imports nothing it does not allow."""
    if "." in name or not name.isidentifier():  # a dotted name walks attributes into anything reachable
        return None
    if (module, name) in _OTHER_SAFE:
        return vars(_allowed_module(module)).get(name)
    if module == "torch":
        # vars(), not getattr(): torch's module __getattr__ imports submodules on demand.
        obj = vars(torch).get(name)
        return obj if isinstance(obj, torch.dtype) else None
    if module not in _METADATA_MODULES:
        return None
    obj = vars(_allowed_module(module)).get(name)
    is_record = isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
    return obj if is_record and obj.__module__ == module else None


def _allowed_module(module: str) -> ModuleType:
    """An allowed module: already imported in practice; otherwise imported here, by its name on our list."""
    loaded = sys.modules.get(module)
    return loaded if loaded is not None else importlib.import_module(module)


def load_metadata(file: IO[bytes] | Any, path: str, op: str, weights_only: bool | None) -> Any:
    """Unpickle a DCP `.metadata` file; only DCP's own records unless `weights_only` is False."""
    if weights_only is False:
        return pickle.load(file)
    try:
        return _MetadataUnpickler(file, path, op).load()
    except (Exception, KeyboardInterrupt):
        # Refusals and malformed bytes (the caller calls those corrupt); Ctrl-C is the user's, not the file's.
        raise
    except BaseException:
        # Nothing the allow-list admits can raise SystemExit or the like; if it ever did, the file must not
        # decide how this process ends.
        raise refused(path, op, []) from None


def check_relative_paths(metadata: Any, path: str, op: str) -> None:
    """Every storage file the metadata names must be a plain file name inside the checkpoint directory."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not _plain_file_name(name):
            raise FabricValueError(
                f"{op}({path!r}): the checkpoint's .metadata names the storage file {name!r}, which is not a file "
                "inside the checkpoint directory ('/', '\\', '..' and absolute paths are refused, so that a "
                "crafted checkpoint cannot read files elsewhere). torch.distributed.checkpoint writes only plain "
                "file names: load a checkpoint written by it, or copy the whole directory again."
            )


def _plain_file_name(name: Any) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(sep in name for sep in ("/", "\\", "\0"))
        and not Path(name).is_absolute()
    )


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
            check_relative_paths(metadata, path, op)
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

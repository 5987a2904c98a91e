"""The files of a sharded checkpoint directory: checking them against `.metadata`, and swapping a new one into place."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fabric.checkpoint.safe import check_relative_paths, load_metadata
from fabric.io import _atomic
from fabric.io._load import UnsafeCheckpointError
from fabric.utilities.exceptions import FabricValueError

METADATA_FILE = ".metadata"  # the name torch.distributed.checkpoint's FileSystemWriter gives it
_MAX_LISTED = 8


def staging_dir(path: Path) -> Path:
    """Where a save writes before the swap: a hidden sibling, so the final rename never crosses file systems.

    Its name is fixed (no random part) so that every rank computes it without communicating.
    """
    return path.with_name(f".{_atomic.fitting(path.name, len('..saving'))}.saving")


def backup_dir(path: Path) -> Path:
    """Where the previous checkpoint waits during a swap on file systems without an atomic exchange."""
    return path.with_name(f".{_atomic.fitting(path.name, len('..old'))}.old")


def is_dcp_directory(path: Path) -> bool:
    """A directory with `.metadata` or shard files: a complete or incomplete DCP checkpoint."""
    if not path.is_dir():
        return False
    return (path / METADATA_FILE).exists() or any(path.glob("*.distcp"))


def _listing(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:_MAX_LISTED])
    return shown + (f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")


def missing_path_error(path: Path, op: str = "load") -> FileNotFoundError:
    """The error for a checkpoint path that does not exist, pointing at a backup left by an interrupted swap."""
    message = f"{op}({str(path)!r}): no checkpoint exists at this path. Check the path, or save one first."
    backup = backup_dir(path)
    if backup.is_dir():
        message += (
            f" A save was interrupted while replacing it; the previous complete checkpoint is at {str(backup)!r}: "
            "rename it back to load it."
        )
    return FileNotFoundError(message)


def read_checked_metadata(path: Path, op: str = "load", weights_only: bool | None = None) -> Any:
    """Read `.metadata` and verify that every file and byte range it refers to is present; return the metadata."""
    if not path.exists():
        raise missing_path_error(path, op)
    metadata_path = path / METADATA_FILE
    if not metadata_path.is_file():
        shards = [p.name for p in path.glob("*.distcp")]
        if shards:
            raise RuntimeError(
                f"{op}({str(path)!r}): the checkpoint is incomplete: {METADATA_FILE} is missing (shard files "
                f"present: {_listing(shards)}). The save that wrote it did not finish; load an earlier checkpoint."
            )
        raise FabricValueError(
            f"{op}({str(path)!r}): this directory is not a torch.distributed.checkpoint (sharded) checkpoint: it "
            f"has no {METADATA_FILE} and no .distcp files. Pass a directory written by a sharded save, or a "
            "checkpoint file."
        )
    try:
        with metadata_path.open("rb") as handle:
            metadata = load_metadata(handle, str(path), op, weights_only)
    except UnsafeCheckpointError:
        raise
    except Exception as err:
        raise RuntimeError(
            f"{op}({str(path)!r}): the checkpoint's {METADATA_FILE} cannot be read ({type(err).__name__}: {err}); "
            "the file is truncated or corrupt. Load an earlier checkpoint."
        ) from None
    _check_storage(path, metadata, op)
    return metadata


def _local_size(path: Path) -> Callable[[str], int | None]:
    def size_of(name: str) -> int | None:
        file = path / name
        return file.stat().st_size if file.is_file() else None

    return size_of


def _check_storage(path: Path, metadata: Any, op: str) -> None:
    check_storage(str(path), metadata, op, _local_size(path))


def check_storage(path: str, metadata: Any, op: str, size_of: Callable[[str], int | None]) -> None:
    """Every file and byte range the metadata refers to must exist (`size_of` gives a file's size or None)."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise RuntimeError(
            f"{op}({path!r}): the checkpoint's {METADATA_FILE} lists no storage files; it was not written "
            "by torch.distributed.checkpoint's FileSystemWriter. Load a checkpoint saved by fabric."
        )
    check_relative_paths(metadata, path, op)
    needed: dict[str, int] = {}  # file -> the end of the last byte range read from it
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    sizes = {name: size_of(name) for name in needed}
    missing = [name for name, size in sizes.items() if size is None]
    short = [
        f"{name} ({size} of {needed[name]} bytes)"
        for name, size in sizes.items()
        if size is not None and size < needed[name]
    ]
    if missing or short:
        problems = []
        if missing:
            problems.append(f"missing files: {_listing(missing)}")
        if short:
            problems.append(f"truncated files: {_listing(short)}")
        raise RuntimeError(
            f"{op}({path!r}): the checkpoint is incomplete: {'; '.join(problems)}. Its {METADATA_FILE} "
            "refers to them; copy the whole directory again, or load an earlier checkpoint."
        )


def prepare_staging(path: Path) -> Path:
    """Rank 0: an empty staging directory (a stale one from an interrupted save is removed first)."""
    staging = staging_dir(path)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def discard_staging(path: Path) -> None:
    """Rank 0, after a failed save: remove what was written; the checkpoint at `path` was never touched."""
    shutil.rmtree(staging_dir(path), ignore_errors=True)


def swap_into_place(path: Path) -> None:
    """Rank 0: make the complete staging directory the checkpoint at `path`, then delete the previous one."""
    staging = staging_dir(path)
    if not path.exists():
        staging.rename(path)
        return
    if _exchange(staging, path):
        shutil.rmtree(staging)  # now holds the previous checkpoint
        return
    # No atomic exchange here: between the two renames the previous checkpoint is complete at the backup path,
    # and load() points there if `path` is missing.
    backup = backup_dir(path)
    if backup.exists():
        shutil.rmtree(backup)
    path.rename(backup)
    staging.rename(path)
    shutil.rmtree(backup)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries in one step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"cannot swap {str(a)!r} into place at {str(b)!r}: {os.strerror(code)}")

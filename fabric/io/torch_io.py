"""TorchCheckpointIO: torch.save / torch.load, atomic on local disks and object stores, safe to load by default."""

from __future__ import annotations

import io
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from fabric.io import _atomic, _fsspec
from fabric.io._load import saved_device_or_cpu, torch_load
from fabric.io._page_cache import release_cached_pages
from fabric.io.checkpoint_io import CheckpointIO


class TorchCheckpointIO(CheckpointIO):
    """Saves with torch.save into a temporary file (or object), then publishes it over the target in one step.

    Paths may be local or fsspec URLs (``s3://bucket/run/last.ckpt``, ``memory://...``); ``storage_options``
    go to the URL's filesystem (credentials, endpoint, ...).
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        """Write atomically: readers see the old checkpoint or the new one, never a partial one."""
        options = _fsspec.check_storage_options(storage_options, path, "save")
        if _fsspec.is_url(path):
            _save_remote(checkpoint, str(path), options)
            return
        target = _fsspec.local(path)
        if target.is_dir():
            raise IsADirectoryError(
                f"save({str(path)!r}): the path is a directory, and a single-file checkpoint cannot replace it. "
                "Choose a file name, or remove the directory first."
            )
        # The file being replaced is still in the page cache; dropping it first keeps the write at disk speed.
        release_cached_pages(target)
        try:
            _atomic.write_atomically(target, lambda handle: torch.save(checkpoint, handle))
        except OSError as err:
            # The temporary file's name means nothing to the user; name the path they gave.
            raise type(err)(
                err.errno,
                f"save({str(path)!r}): the checkpoint could not be written there ({err.strerror or err}). Check "
                "that the directory is writable and has free space, or choose another path.",
            ) from err

    def load_checkpoint(
        self, path: str | Path, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Read a checkpoint. Tensors return to the device they were saved from where it exists (CPU otherwise)
        unless `map_location` says otherwise; arbitrary objects are unpickled only with ``weights_only=False``."""
        location = map_location if map_location is not None else saved_device_or_cpu
        if _fsspec.is_url(path):
            data, where = _read_remote(str(path))
            return torch_load(data, where, "load", location, weights_only)
        local = _fsspec.local(path)
        if not local.exists():
            raise FileNotFoundError(
                f"load({str(path)!r}): no checkpoint exists at this path. Check the path, or save one first."
            )
        if local.is_dir():
            raise IsADirectoryError(
                f"load({str(path)!r}): this is a directory, not a single-file checkpoint. "
                "Pass the checkpoint file inside it, or use a strategy that writes sharded directories."
            )
        return torch_load(str(local), str(path), "load", location, weights_only)

    def remove_checkpoint(self, path: str | Path) -> None:
        """Delete a file or a checkpoint directory."""
        if _fsspec.is_url(path):
            fs, inner = _fsspec.filesystem(str(path), "remove_checkpoint")
            if fs.exists(inner):
                fs.rm(inner, recursive=True)
            return
        local = _fsspec.local(path)
        if local.is_dir():
            shutil.rmtree(local)
        else:
            local.unlink(missing_ok=True)


def _save_remote(checkpoint: dict[str, Any], url: str, storage_options: dict[str, Any] | None) -> None:
    fs, inner = _fsspec.filesystem(url, "save", storage_options)
    if fs.isdir(inner):
        raise IsADirectoryError(
            f"save({url!r}): the path is a directory, and a single-file checkpoint cannot replace it. Choose a "
            "file name, or remove the directory first."
        )
    # Serialize completely first: an object that fails to pickle never reaches the store.
    with tempfile.TemporaryDirectory(prefix="fabric-save-") as scratch:
        local = Path(scratch, "checkpoint")
        torch.save(checkpoint, local)
        if _fsspec.publishes_whole(fs):
            # One upload (a PUT, or a multipart upload completed only at its end) replaces the object at once.
            fs.put_file(str(local), inner)
            return
        # Stores with real directories: upload beside the target, then rename over it.
        _, staged = _fsspec.sibling(url, fs, inner, _atomic.remote_temp_name, "save")
        fs.makedirs(fs._parent(staged), exist_ok=True)
        fs.put_file(str(local), staged)
        try:
            fs.mv(staged, inner)
        except BaseException:
            if fs.exists(staged):
                fs.rm(staged)
            raise


def _read_remote(url: str) -> tuple[io.BytesIO, str]:
    fs, inner = _fsspec.filesystem(url, "load")
    if not fs.exists(inner):
        raise FileNotFoundError(f"load({url!r}): no checkpoint exists at this URL. Check it, or save one first.")
    if fs.isdir(inner):
        raise IsADirectoryError(
            f"load({url!r}): this is a directory, not a single-file checkpoint. Pass the checkpoint file inside it."
        )
    # torch.load needs a seekable file; one read beats many small ranged requests to a remote store.
    return io.BytesIO(fs.cat_file(inner)), url

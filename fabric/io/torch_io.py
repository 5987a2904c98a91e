"""TorchCheckpointIO: torch.save / torch.load with atomic replacement of the target file."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from fabric.io._page_cache import release_cached_pages
from fabric.io.checkpoint_io import CheckpointIO
from fabric.utilities.exceptions import FabricTypeError


def _default_file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


class TorchCheckpointIO(CheckpointIO):
    """Saves with torch.save into a temporary file, then renames it over the target."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        """Write atomically: readers see the old file or the new one, never a partial one."""
        if storage_options is not None:
            raise FabricTypeError(
                f"TorchCheckpointIO.save_checkpoint(storage_options={storage_options!r}): this plugin takes no "
                "storage options. Pass a CheckpointIO plugin that supports them, or leave them out."
            )
        path = Path(path)
        if path.is_dir():
            raise IsADirectoryError(
                f"save({str(path)!r}): the path is a directory, and a single-file checkpoint cannot replace it. "
                "Choose a file name, or remove the directory first."
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        release_cached_pages(path)
        # Same directory as the target, so the final rename never crosses file systems.
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                torch.save(checkpoint, handle)
                handle.flush()
                os.fsync(handle.fileno())
            # mkstemp creates the file private (0o600); give it the mode a plain torch.save would have.
            Path(tmp_name).chmod(_default_file_mode())
            Path(tmp_name).replace(path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise

    def load_checkpoint(self, path: str | Path, map_location: Any = None) -> dict[str, Any]:
        """Read a checkpoint; tensors land on CPU unless `map_location` says otherwise."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(
                f"load({str(path)!r}): no checkpoint exists at this path. Check the path, or save one first."
            )
        if path.is_dir():
            raise IsADirectoryError(
                f"load({str(path)!r}): this is a directory, not a single-file checkpoint. "
                "Pass the checkpoint file inside it, or use a strategy that writes sharded directories."
            )
        # weights_only=False: checkpoints hold arbitrary user objects (plain values in `state`).
        return torch.load(path, map_location=map_location or "cpu", weights_only=False)

    def remove_checkpoint(self, path: str | Path) -> None:
        """Delete a file or a checkpoint directory."""
        path = Path(path)
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)

"""is_shared_filesystem: whether every process sees the same files under a path (so one rank may write them)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fabric.utilities.cloud_io import _is_local_file_protocol
from fabric.utilities.types import _PATH

if TYPE_CHECKING:
    from fabric.strategies import Strategy

_CHECK_FILE = ".fabric_shared_fs_check"


def is_shared_filesystem(strategy: Strategy, path: _PATH | None = None, timeout: int = 3) -> bool:
    """Whether ``path`` (default: the working directory) is one shared file system for all processes.

    Every process must call it (it runs collectives). Remote URLs (``s3://``, ...) count as shared. Rank 0
    creates a marker file in ``path`` (which must exist and be writable); the directory is shared when
    every other rank sees the file within ``timeout`` seconds. ``strategy`` is ``fabric.strategy``.
    """
    if path is not None and not _is_local_file_protocol(path):
        return True
    if strategy.world_size == 1:
        return True
    resolved = Path.cwd() if path is None else Path(path).resolve()
    # Different absolute paths on different ranks cannot be one shared directory.
    if not strategy.reduce_boolean_decision(strategy.broadcast(resolved) == resolved, all=True):
        return False
    if not strategy.reduce_boolean_decision(resolved.exists(), all=True):
        raise FileNotFoundError(
            f"is_shared_filesystem(path={str(resolved)!r}): the path does not exist on every process, so it "
            "cannot be checked. Create it first (on every machine, if they do not share it)."
        )
    directory = resolved.parent if resolved.is_file() else resolved
    marker = directory / _CHECK_FILE
    marker.unlink(missing_ok=True)
    strategy.barrier()
    found = _create_or_wait_for(marker, strategy.is_global_zero, timeout)
    strategy.barrier()
    shared = strategy.reduce_boolean_decision(found, all=True)
    with contextlib.suppress(OSError):  # another rank on the same file system may have removed it already
        marker.unlink()
    return shared


def _create_or_wait_for(marker: Path, is_creator: bool, timeout: float) -> bool:
    if is_creator:
        marker.touch()
        return True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if marker.exists():
            return True
        time.sleep(0.01)
    return marker.exists()

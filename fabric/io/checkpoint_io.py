"""The CheckpointIO role: bytes on storage (save, load, remove)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any


class CheckpointIO(ABC):
    """Writes and reads checkpoint dictionaries; knows nothing about models or ranks."""

    # True for plugins whose saves return before the bytes are written (AsyncCheckpointIO).
    asynchronous: bool = False

    @abstractmethod
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        """Write `checkpoint` to `path` so that a failure never leaves a half-written file there."""

    @abstractmethod
    def load_checkpoint(
        self, path: str | Path, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Read the checkpoint at `path`; unless `weights_only` is False, refuse anything that could run code."""

    @abstractmethod
    def remove_checkpoint(self, path: str | Path) -> None:
        """Delete the checkpoint at `path`."""

    def submit(self, path: str | Path, job: Callable[[], None]) -> None:
        """Run `job`, the writing part of a save to `path` done by a strategy itself; asynchronous plugins defer it."""
        job()

    def wait(self) -> None:  # noqa: B027 - optional hook
        """Block until saves that returned early are written; raise the error of one that failed."""

    def teardown(self) -> None:  # noqa: B027 - optional hook
        """Release resources such as open handles or threads."""

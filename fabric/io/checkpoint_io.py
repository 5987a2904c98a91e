"""The CheckpointIO role: bytes on storage (save, load, remove)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any


class CheckpointIO(ABC):
    """Writes and reads checkpoint dictionaries; knows nothing about models or ranks."""

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

    def teardown(self) -> None:  # noqa: B027 - optional hook
        """Release resources such as open handles or threads."""

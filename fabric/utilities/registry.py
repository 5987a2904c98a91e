"""Lightning Fabric's import path ``utilities.registry``: callbacks that installed packages offer through entry
points (Lightning's group for Fabric is ``lightning.fabric.callbacks_factory``)."""

from __future__ import annotations

import logging
from importlib.metadata import entry_points
from typing import Any

log = logging.getLogger(__name__)


def _load_external_callbacks(group: str) -> list[Any]:
    """Every callback the entry points of ``group`` produce: each entry point is a factory returning one
    callback or a list of them."""
    callbacks: list[Any] = []
    for entry_point in entry_points(group=group):
        made = entry_point.load()()
        made = made if isinstance(made, list) else [made]
        if made:
            log.info(
                f"Adding {len(made)} callbacks from entry point {entry_point.name!r}: "
                + ", ".join(type(callback).__name__ for callback in made)
            )
        callbacks.extend(made)
    return callbacks


__all__ = ["_load_external_callbacks"]

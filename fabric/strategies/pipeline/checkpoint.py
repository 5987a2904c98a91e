"""Loading a sharded checkpoint into a pipeline: each process reads its stages' entries, whatever split saved them.

Saving needs nothing of its own: each process's model holds only its stages, under the whole model's names, so the
usual sharded (DCP) save writes one checkpoint of the whole model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.nn import Module

from fabric.checkpoint import files, remote
from fabric.checkpoint import sharded as _sharded
from fabric.checkpoint.sharded_state import check_keys
from fabric.checkpoint.state import unwrap
from fabric.io import _fsspec
from fabric.utilities.exceptions import FabricValueError


def load(path: str | Path, state: dict[str, Any], strict: bool, weights_only: bool | None) -> dict[str, Any]:
    """Check the whole model's keys against the checkpoint (together: each process has only its own), then let
    every process read its entries with a partial load."""
    saved = _saved_keys(path, weights_only)
    if strict:
        missing = [key for key in state if key not in saved]
        if missing:
            raise KeyError(
                f"load({str(path)!r}, state with keys {sorted(state)}): the checkpoint has no entry for {missing}; "
                f"it holds {sorted(saved)}. Load with strict=False to skip missing entries, or fix the keys."
            )
        for key, value in state.items():
            module = unwrap(value)
            if isinstance(module, Module) and key in saved:
                _check_module_keys(str(path), key, set(module.state_dict()), saved[key])
    return _sharded.load(path, state, strict=False, weights_only=weights_only)


def _check_module_keys(path: str, key: str, local: set[str], saved: set[str]) -> None:
    # Every process checks the union of all processes' names, so all of them raise alike (no one waits alone).
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(local))
    whole = set().union(*gathered)
    target = "the whole model that the pipeline's stages make up"
    check_keys(path, key, whole, saved, strict=True, is_module=True, target=target)


def _saved_keys(path: str | Path, weights_only: bool | None) -> dict[str, set[str]]:
    """Each top-level entry's names inside it (a module's parameter and buffer names), from the metadata."""
    if _fsspec.is_url(path):
        metadata = remote.read_checked_metadata(str(path), "load", weights_only)
    else:
        metadata = files.read_checked_metadata(Path(_fsspec.local(path)), "load", weights_only)
    mapping = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    keys: dict[str, set[str]] = {}
    for flat in metadata.state_dict_metadata:
        parts = [str(part) for part in mapping.get(flat, (flat,))]
        keys.setdefault(parts[0], set()).add(".".join(parts[1:]))
    return keys


def refuse_full_file(path: str | Path, state: Any, owner: str) -> None:
    """A single-file checkpoint holds the whole model; a pipeline process holds only its stages."""
    values = state.values() if isinstance(state, dict) else [state]
    if any(isinstance(unwrap(value), Module) for value in values):
        raise FabricValueError(
            f"load({str(path)!r}) under {owner}: this is a single-file checkpoint of a whole model, and each process "
            "here holds only its stages. Load the file into the whole model before fabric.setup() (which then keeps "
            "each process's stages), or load a checkpoint that fabric.save wrote under a PipelineStrategy."
        )

"""Saving and loading `xla_fsdp` checkpoints: a directory of per-process shards, or one consolidated file."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.nn import Module
from torch.optim import Optimizer

from fabric.checkpoint import state as _checkpoint
from fabric.checkpoint import xla_fsdp as _format
from fabric.utilities.exceptions import FabricTypeError, FabricValueError

if TYPE_CHECKING:
    from fabric.strategies.xla.fsdp import XLAFSDPStrategy


def _wrapped(value: Any) -> Module | None:
    """The XlaFullyShardedDataParallel behind a value of the user's state (the wrapper fabric returned), if any."""
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel

    candidate = getattr(value, "_forward_module", value)
    return candidate if isinstance(candidate, XlaFullyShardedDataParallel) else None


def _the_model(state: dict[str, Any], operation: str) -> tuple[str, Module]:
    found = [(key, module) for key, value in state.items() if (module := _wrapped(value)) is not None]
    if len(found) != 1:
        what = "no model set up by fabric.setup_module()" if not found else f"{len(found)} sharded models"
        raise FabricValueError(
            f"{operation}(state with keys {sorted(state)}) with strategy='xla_fsdp': the state holds {what}; an "
            "xla_fsdp checkpoint holds exactly one. Put the model that fabric.setup_module() returned in the state "
            "(save several models to several paths)."
        )
    return found[0]


def save(
    strategy: XLAFSDPStrategy,
    path: Path,
    state: dict[str, Any],
    storage_options: Any,
    filter: dict[str, Callable[[str, Any], bool]] | None,
) -> None:
    """Every process writes its shard; for 'full', rank 0 then merges the shards into the file at `path`."""
    import torch_xla

    from fabric.io.xla import xla_state_to_cpu

    key, model = _the_model(state, "save")
    full = strategy._state_dict_type == "full"
    if full and strategy.num_processes != strategy.world_size:
        raise OSError(
            f"save({str(path)!r}) with XLAFSDPStrategy(state_dict_type='full'): the processes run on several hosts, "
            "which share no directory in which rank 0 could merge the shards. Use state_dict_type='sharded' and "
            "merge later with fabric.strategies.xla.consolidate_xla_fsdp_checkpoint."
        )
    directory = path.parent / f".{path.name}.shards" if full else path
    # Rank 0's view decides for everyone, so that all processes raise, or none does.
    occupied = strategy.broadcast(directory.is_dir() and any(directory.iterdir()))
    if occupied and not full:
        raise FileExistsError(
            f"save({str(path)!r}) with strategy='xla_fsdp': the directory exists and is not empty, and the "
            "shards of two checkpoints must not mix. Choose a new path, or remove the old checkpoint first."
        )
    if occupied and strategy.is_global_zero:
        shutil.rmtree(directory)  # left over from an interrupted full save
    torch_xla.sync()
    converted = _checkpoint.convert_state(
        {k: (model if k == key else v) for k, v in state.items()},
        lambda module: module.state_dict(),
        strategy.get_optimizer_state,
        filter,
    )
    converted[_format.SHARD_METADATA_KEY] = model.get_shard_metadata()  # type: ignore[operator]
    converted = xla_state_to_cpu(converted)
    target = _format.shard_file(directory, strategy.global_rank, strategy.world_size)
    strategy.barrier("fabric-xla-fsdp-save-start")  # rank 0 has cleared the directory
    for turn in range(strategy.num_processes if strategy._sequential_save else 1):
        if not strategy._sequential_save or turn == strategy.local_rank:
            directory.mkdir(parents=True, exist_ok=True)
            strategy.checkpoint_io.save_checkpoint(converted, target, storage_options=storage_options)
        if strategy._sequential_save:
            strategy.barrier(f"fabric-xla-fsdp-save-{turn}")
    if strategy.is_global_zero:
        _format.write_metadata(directory, key, strategy.world_size)
    if full:
        _write_full(strategy, path, directory, converted)


def _write_full(strategy: XLAFSDPStrategy, path: Path, directory: Path, converted: dict[str, Any]) -> None:
    strategy.barrier("fabric-xla-fsdp-full-save")
    if strategy.is_global_zero:
        if any(_format.is_optimizer_state(v) for v in converted.values()):
            warnings.warn(
                f"save({str(path)!r}) with XLAFSDPStrategy(state_dict_type='full'): the optimizer state is sharded "
                "and is not part of a full checkpoint; it was left out. Use state_dict_type='sharded' to resume "
                "training with it.",
                stacklevel=5,
            )
        merged = _format.consolidate_xla_fsdp_checkpoint(directory)
        strategy.checkpoint_io.save_checkpoint(merged, path)
        shutil.rmtree(directory)
    strategy.barrier("fabric-xla-fsdp-full-saved")


def load_shard(
    strategy: XLAFSDPStrategy,
    path: Path,
    state: dict[str, Any] | Module | Optimizer | None,
    strict: bool,
    weights_only: bool | None,
) -> dict[str, Any]:
    """Restore this process's shard into the sharded model, its optimizers and the plain entries of `state`."""
    if not isinstance(state, dict) or not state:
        raise FabricTypeError(
            f"load({str(path)!r}, state={type(state).__name__}) with strategy='xla_fsdp': a sharded checkpoint "
            "loads into a state dict holding the sharded model, e.g. {'model': model, 'optimizer': optimizer}. "
            "To read the full weights, merge the shards with fabric.strategies.xla.consolidate_xla_fsdp_checkpoint."
        )
    key, model = _the_model(state, "load")
    file = _format.shard_file(path, strategy.global_rank, strategy.world_size)
    if not file.is_file():
        raise FileNotFoundError(
            f"load({str(path)!r}) with strategy='xla_fsdp': there is no shard {file.name} for rank "
            f"{strategy.global_rank} of {strategy.world_size}; the checkpoint was written by a different number of "
            "processes (or is incomplete). Load it with as many processes as saved it, or merge it with "
            "fabric.strategies.xla.consolidate_xla_fsdp_checkpoint and load the full weights before setup_module."
        )
    checkpoint = strategy.checkpoint_io.load_checkpoint(file, map_location="cpu", weights_only=weights_only)
    checkpoint.pop(_format.SHARD_METADATA_KEY, None)
    targets = {k: (model if k == key else v) for k, v in state.items()}
    remainder = _checkpoint.restore_state(targets, checkpoint, strict, str(path))
    for name, value in targets.items():
        if name != key:
            state[name] = value  # plain entries were replaced in `targets`; objects were loaded in place
    return remainder


def check_full_load(path: Any, state: Any) -> None:
    """A full checkpoint holds unwrapped weights: it loads into the model before setup_module, not into shards."""
    targets = list(state.values()) if isinstance(state, dict) else [state]
    if any(_wrapped(value) is not None for value in targets):
        raise FabricValueError(
            f"load({str(path)!r}) with strategy='xla_fsdp': this is a full checkpoint (one file of unwrapped "
            "weights), and it cannot be loaded into a model that is already sharded. Load it into the model before "
            "fabric.setup_module(model), e.g. model.load_state_dict(torch.load(path)['model']), then set it up."
        )

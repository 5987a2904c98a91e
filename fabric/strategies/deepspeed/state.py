"""Saving and loading DeepSpeed engines through fabric.save / fabric.load (atomic, world-size aware)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.nn import Module
from torch.optim import Optimizer

from fabric.checkpoint import files
from fabric.checkpoint import state as _checkpoint
from fabric.io._fsspec import local_only
from fabric.strategies.deepspeed import checkpoint as ckpt
from fabric.utilities.exceptions import FabricTypeError, FabricValueError

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


def split_state(state: dict[str, Any], engine: DeepSpeedEngine, operation: str) -> tuple[str, str | None, list[str]]:
    """The key of the engine's model, of its optimizer (or None), and the other keys."""
    if not isinstance(state, dict):
        raise FabricTypeError(
            f"{operation}(state={type(state).__name__}): the state must be a dict such as "
            "{'model': model, 'optimizer': optimizer, 'step': step}. Wrap your objects in a dict."
        )
    objects = {key: _checkpoint.unwrap(value) for key, value in state.items()}
    modules = [key for key, value in objects.items() if isinstance(value, Module)]
    optimizers = [key for key, value in objects.items() if isinstance(value, Optimizer)]
    if len(modules) != 1 or objects[modules[0]] not in (engine.module, engine):
        raise FabricValueError(
            f"{operation}(state with models {modules}): DeepSpeed checkpoints hold exactly one model, the one "
            "given to fabric.setup(). Put that model (and only it) in the state."
        )
    if len(optimizers) > 1:
        raise FabricValueError(
            f"{operation}(state with optimizers {optimizers}): DeepSpeed drives one optimizer. Put only the "
            "optimizer returned by fabric.setup() in the state."
        )
    others = [key for key in state if key not in modules and key not in optimizers]
    return modules[0], (optimizers[0] if optimizers else None), others


def save(
    engine: DeepSpeedEngine,
    path: str | Path,
    state: dict[str, Any],
    filter: dict[str, Callable[[str, Any], bool]] | None,
    is_global_zero: bool,
    barrier: Callable[[], None],
    exclude_frozen_parameters: bool,
) -> None:
    """Every rank writes its shard into a sibling temporary directory; rank 0 then swaps it in."""
    if filter:
        raise FabricValueError(
            f"save({str(path)!r}, filter={sorted(filter)}): DeepSpeed writes its own sharded files and cannot "
            "filter them. Drop the filter."
        )
    module_key, optimizer_key, others = split_state(state, engine, "save")
    client = _checkpoint.convert_state(
        {k: state[k] for k in others}, lambda m: m.state_dict(), lambda o: o.state_dict(), None
    )
    client[ckpt.MODULE_KEY] = module_key
    client[ckpt.OPTIMIZER_KEY] = optimizer_key
    path = local_only(path, "save", "DeepSpeed checkpoints")
    # The same staging directory and swap as torch.distributed.checkpoint saves (atomic exchange where supported).
    if is_global_zero:
        files.prepare_staging(path)  # also clears the leftover of a save that crashed
    barrier()
    engine.save_checkpoint(
        str(files.staging_dir(path)),
        tag=ckpt.TAG,
        client_state=client,
        exclude_frozen_parameters=exclude_frozen_parameters,
    )
    barrier()
    if is_global_zero:
        files.swap_into_place(path)


def load(
    engine: DeepSpeedEngine,
    path: str | Path,
    state: dict[str, Any],
    strict: bool,
    world_size: int,
    is_global_zero: bool,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Restore model, optimizer and client state in place; on another world size, the model weights only.

    Unless `weights_only` is False, every file of the checkpoint is checked for code-running pickles first:
    DeepSpeed's own loading unpickles them without restriction."""
    _, optimizer_key, others = split_state(state, engine, "load")
    directory = ckpt.tag_dir(path)
    states = ckpt.read_model_states(directory, path, weights_only)
    saved_ranks = ckpt.saved_world_size(states)
    if ckpt.saved_stage(states) > 0:
        ckpt.check_rank_files(directory, saved_ranks, path)
    if saved_ranks == world_size:
        loaded, _ = engine.load_checkpoint(
            str(path),
            tag=directory.name,  # the folder check_safe vetted (DeepSpeed would read another one if told to)
            load_module_strict=strict,
            load_optimizer_states=optimizer_key is not None,
            load_lr_scheduler_states=False,
        )
        if loaded is None:
            raise RuntimeError(f"load({str(path)!r}): DeepSpeed could not read the checkpoint. See its log above.")
    else:
        load_full_weights(engine, ckpt.full_weights(path, weights_only=weights_only), strict, str(path))
        if optimizer_key is not None and is_global_zero:
            warnings.warn(
                f"load({str(path)!r}): the checkpoint was written by {saved_ranks} ranks and this run has "
                f"{world_size}, so only the model weights were restored; the optimizer state "
                f"({optimizer_key!r}) starts fresh. Resume on {saved_ranks} ranks to keep it.",
                stacklevel=4,
            )
    client = ckpt.client_entries(states)
    subset = {key: state[key] for key in others}
    remainder = _checkpoint.restore_state(subset, client, strict, str(path))
    state.update(subset)
    return remainder


def load_full_weights(engine: DeepSpeedEngine, weights: dict[str, Any], strict: bool, where: str) -> None:
    """Load a full (unsharded) state dict into the engine's model and its optimizer's master copy."""
    module = engine.module
    if engine.zero_optimization_partition_weights():
        import deepspeed

        # Stage 3: gather each parameter, let rank 0 write it, and re-partition (DeepSpeed broadcasts rank 0's).
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
            if engine.global_rank == 0:
                _checkpoint._load_module(module, weights, strict, where)
    else:
        _checkpoint._load_module(module, weights, strict, where)
    refresh = getattr(engine.optimizer, "refresh_fp32_params", None)
    if callable(refresh):
        # ZeRO and bf16 optimizers step on float32 master copies made at setup; copy the new weights into them.
        refresh()

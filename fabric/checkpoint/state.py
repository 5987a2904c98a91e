"""Turning user state into checkpoint dictionaries and back, the same for every strategy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.nn import Module
from torch.optim import Optimizer

from fabric._dataloader import _FabricDataLoader
from fabric.utilities._loader_state import collect as collect_loader
from fabric.utilities._loader_state import refuse_plain_loader
from fabric.utilities.exceptions import FabricTypeError
from fabric.wrappers import unwrap_objects


def unwrap(obj: Any) -> Any:
    """The user's own module or optimizer behind fabric's wrappers."""
    return unwrap_objects(obj)


def convert_state(
    state: dict[str, Any],
    module_state: Callable[[Module], dict[str, Any]],
    optimizer_state: Callable[[Optimizer], dict[str, Any]],
    filter: dict[str, Callable[[str, Any], bool]] | None,
) -> dict[str, Any]:
    """Replace modules, optimizers and stateful objects by their state dicts; apply `filter` per key."""
    if not isinstance(state, dict):
        raise FabricTypeError(
            f"save(state={type(state).__name__}): the state must be a dict such as "
            "{'model': model, 'optimizer': optimizer, 'step': step}. Wrap your objects in a dict."
        )
    filter = filter or {}
    unknown = set(filter) - set(state)
    if unknown:
        raise KeyError(
            f"save(filter={sorted(unknown)}): these filter keys are not in the state {sorted(state)}. "
            "Use the same keys as in the state dict."
        )
    converted: dict[str, Any] = {}
    for key, value in state.items():
        value = unwrap(value)
        refuse_plain_loader("save", key, value)
        if isinstance(value, _FabricDataLoader):
            value = collect_loader(value)  # every rank's position, so that each gets its own back
        elif isinstance(value, Module):
            value = module_state(value)
        elif isinstance(value, Optimizer):
            value = optimizer_state(value)
        elif callable(getattr(value, "state_dict", None)) and not isinstance(value, dict):
            value = value.state_dict()
        if key in filter:
            if not isinstance(value, dict):
                raise FabricTypeError(
                    f"save(filter={{{key!r}: ...}}): state[{key!r}] is not a dict or an object with a state dict, "
                    "so there is nothing to filter. Remove this key from the filter."
                )
            keep = filter[key]
            value = {k: v for k, v in value.items() if keep(k, v)}
        converted[key] = value
    return converted


def restore_state(state: dict[str, Any], checkpoint: dict[str, Any], strict: bool, path: str) -> dict[str, Any]:
    """Load checkpoint entries into the objects in `state`, in place; return the unconsumed entries."""
    missing = [key for key in state if key not in checkpoint]
    if missing and strict:
        raise KeyError(
            f"load({path!r}, state with keys {sorted(state)}): the checkpoint has no entry for {missing}; it "
            f"holds {sorted(checkpoint)}. Load with strict=False to skip missing entries, or fix the keys."
        )
    remainder = dict(checkpoint)
    for key in state:
        if key not in remainder:
            continue
        saved = remainder.pop(key)
        target = unwrap(state[key])
        refuse_plain_loader("load", key, target)
        if isinstance(target, Module):
            _load_module(target, saved, strict, f"{path}[{key!r}]")
        elif isinstance(target, Optimizer) or callable(getattr(target, "load_state_dict", None)):
            target.load_state_dict(saved)
        else:
            state[key] = saved
    return remainder


def place_plain(
    checkpoint: dict[str, Any], state: dict[str, Any] | Module | Optimizer | None, place: Callable[[Any], Any]
) -> dict[str, Any]:
    """Apply `place` (back to the saved device) to the entries that stay plain values: not those a module,
    optimizer or stateful object in `state` loads itself (load_state_dict copies into the object's own device)."""
    if isinstance(state, (Module, Optimizer)):
        return checkpoint
    placed = dict(checkpoint)
    for key, value in checkpoint.items():
        if isinstance(state, dict) and key in state and _loads_itself(unwrap(state[key])):
            continue
        placed[key] = place(value)
    return placed


def _loads_itself(target: Any) -> bool:
    return isinstance(target, (Module, Optimizer)) or callable(getattr(target, "load_state_dict", None))


def load_raw_into(obj: Module | Optimizer, checkpoint: dict[str, Any], strict: bool, path: str) -> None:
    """Load a plain state dict file into one module or optimizer."""
    target = unwrap(obj)
    if isinstance(target, Module):
        _load_module(target, checkpoint, strict, path)
    else:
        target.load_state_dict(checkpoint)


def _load_module(module: Module, state_dict: dict[str, Any], strict: bool, where: str) -> None:
    try:
        module.load_state_dict(state_dict, strict=strict)
    except RuntimeError as err:
        raise RuntimeError(
            f"load({where}): the saved weights do not fit {type(module).__name__}: {err}. Load into the model "
            "the checkpoint was saved from, or pass strict=False to skip missing and unexpected keys."
        ) from None


# -- loss scaler ----------------------------------------------------------------------------------------
# Where fabric.save puts the precision's loss-scaler state (scale, growth tracker, ...), beside the user's keys.
# A top-level entry of plain numbers: a plain file, a sharded directory (DCP stores it as non-tensor values) and
# a full file all hold it alike, and a checkpoint without it (older, or saved without a scaler) still loads.
SCALER_KEY = "fabric_grad_scaler"


def with_scaler_state(state: dict[str, Any], precision_state: dict[str, Any]) -> dict[str, Any]:
    """`state` plus the scaler's state when this is a training checkpoint (it holds an optimizer).

    Without it a resumed float16 run restarts at the initial scale (65536) and skips steps until it has backed
    off again. A user who saves their own entry under the same key keeps it.
    """
    if not precision_state or not isinstance(state, dict) or SCALER_KEY in state:
        return state
    if not any(isinstance(unwrap(value), Optimizer) for value in state.values()):
        return state
    return {**state, SCALER_KEY: precision_state}


def restore_scaler_state(
    remainder: dict[str, Any], asked: Any, load_precision_state: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """Give a saved scaler state back to the precision and keep it out of what fabric.load returns."""
    if not isinstance(asked, dict) or SCALER_KEY in asked or SCALER_KEY not in remainder:
        return remainder
    remainder = dict(remainder)
    load_precision_state(remainder.pop(SCALER_KEY))
    return remainder

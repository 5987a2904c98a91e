"""User state <-> torch.distributed.checkpoint.state_dict form: parameter-name keyed, sharded (DTensor) or full."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric.checkpoint import state as _checkpoint
from fabric.checkpoint.state import unwrap
from fabric.utilities.exceptions import FabricValueError


def _options(full: bool, strict: bool = True) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # cpu_offload with full_state_dict gathers onto rank 0 only, so the other ranks never hold the whole model.
    return StateDictOptions(full_state_dict=full, cpu_offload=full, strict=strict)


def modules_of(state: dict[str, Any]) -> dict[str, Module]:
    """The modules in `state`, unwrapped, by key."""
    unwrapped = {key: unwrap(value) for key, value in state.items()}
    return {key: value for key, value in unwrapped.items() if isinstance(value, Module)}


def owner_of(op: str, key: str, optimizer: Optimizer, modules: dict[str, Module]) -> Module:
    """The module in the state that holds all of the optimizer's parameters (the first such, in state order)."""
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    touching = []
    for module_key, module in modules.items():
        owned = {id(p) for p in module.parameters()}
        if wanted <= owned:
            return module
        if wanted & owned:
            touching.append(module_key)
    if not touching:
        raise FabricValueError(
            f"{op}(state[{key!r}]): the optimizer's parameters belong to none of the modules in the state "
            f"({sorted(modules) or 'there are none'}). A sharded checkpoint stores optimizer state by parameter "
            f"name, which needs the module that owns the parameters: put it in the same state, e.g. "
            f"{{'model': model, {key!r}: optimizer}}."
        )
    raise FabricValueError(
        f"{op}(state[{key!r}]): the optimizer's parameters are spread over the modules {touching}, and a sharded "
        "checkpoint names optimizer state after one module's parameters. Put those modules in one nn.Module "
        "(such as an nn.ModuleDict) and save that, or use one optimizer per module."
    )


def _key_of(state: dict[str, Any], obj: Any) -> str:
    return next(key for key, value in state.items() if unwrap(value) is obj)


def convert(
    op: str, state: dict[str, Any], filter: dict[str, Callable[[str, Any], bool]] | None, full: bool
) -> dict[str, Any]:
    """Modules and optimizers as parameter-name keyed state dicts (DTensor leaves unless `full`); the rest as
    `fabric.save` converts it (objects through their state_dict, `filter` applied per key)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if not isinstance(state, dict):
        return _checkpoint.convert_state(state, _no_module, _no_optimizer, filter)  # raises its TypeError
    modules = modules_of(state)
    # Gathering onto rank 0 needs a process group; a single process already holds everything.
    options = _options(full and distributed())

    def module_state(module: Module) -> dict[str, Any]:
        return get_model_state_dict(module, options=options)

    def optimizer_state(optimizer: Optimizer) -> dict[str, Any]:
        owner = owner_of(op, _key_of(state, optimizer), optimizer, modules)
        return dict(get_optimizer_state_dict(owner, optimizer, options=options))

    return _checkpoint.convert_state(state, module_state, optimizer_state, filter)


def _no_module(module: Module) -> dict[str, Any]:
    raise AssertionError("unreachable: convert_state rejects a non-dict state first")


def _no_optimizer(optimizer: Optimizer) -> dict[str, Any]:
    raise AssertionError("unreachable: convert_state rejects a non-dict state first")


def distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def load_targets(op: str, state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """For each module and optimizer in `state`: a state dict in this process's layout for DCP to fill in place.

    A fresh optimizer has no state yet; get_optimizer_state_dict initialises it (a step with zero gradients and
    the learning rate at 0), so its tensors exist to load into.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    modules = modules_of(state)
    targets: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        obj = unwrap(value)
        if isinstance(obj, Module):
            targets[key] = get_model_state_dict(obj)
        elif isinstance(obj, Optimizer):
            targets[key] = dict(get_optimizer_state_dict(owner_of(op, key, obj, modules), obj))
    return targets


def apply_loaded(op: str, state: dict[str, Any], loaded: dict[str, dict[str, Any]], strict: bool, full: bool) -> None:
    """Load the filled-in state dicts into the modules and optimizers of `state`."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    modules = modules_of(state)
    for key, saved in loaded.items():
        obj = unwrap(state[key])
        if isinstance(obj, Module):
            set_model_state_dict(obj, saved, options=load_options(full, strict))
        else:
            owner = owner_of(op, key, obj, modules)
            set_optimizer_state_dict(owner, obj, _named_optimizer_state(saved, obj, owner), options=load_options(full))


def load_options(full: bool, strict: bool = True) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, strict=strict)


def _named_optimizer_state(saved: dict[str, Any], optimizer: Optimizer, owner: Module) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name; plain `optimizer.state_dict()` (keyed by position, as the
    single-device and DDP strategies save it) is renamed through the owner's parameter names."""
    groups = saved.get("param_groups", [])
    if not groups or all(isinstance(name, str) for group in groups for name in group["params"]):
        return saved
    names = {id(p): name for name, p in owner.named_parameters()}
    position_to_name: dict[int, str] = {}
    for saved_group, group in zip(groups, optimizer.param_groups, strict=False):
        for index, param in zip(saved_group["params"], group["params"], strict=False):
            position_to_name[index] = names[id(param)]
    return {
        "state": {position_to_name[int(i)]: value for i, value in saved.get("state", {}).items()},
        "param_groups": [
            {**group, "params": [position_to_name[i] for i in group["params"]]} for group in saved["param_groups"]
        ],
    }


def global_shape(value: Any) -> tuple[int, ...] | None:
    """The shape of the whole tensor (a DTensor's shape is already global); None for a non-tensor."""
    return tuple(value.shape) if isinstance(value, Tensor) else None


def check_shapes(path: str, expected: dict[str, Any], saved: dict[str, tuple[int, ...] | None]) -> None:
    """Fail before anything is loaded if a saved tensor does not fit the object it would load into."""
    wrong = []
    for name, value in expected.items():
        want = global_shape(value)
        if name in saved and want is not None and saved[name] != want:
            shown = "not a tensor" if saved[name] is None else list(saved[name] or ())
            wrong.append(f"{name!r}: saved {shown}, expected {list(want)}")
    if wrong:
        listed = "; ".join(wrong[:8]) + (f"; and {len(wrong) - 8} more" if len(wrong) > 8 else "")
        raise RuntimeError(
            f"load({path!r}): the checkpoint does not fit the objects it is loaded into: {listed}. Load into "
            "objects built like the ones that were saved (same layer sizes)."
        )


def check_keys(
    path: str,
    key: str,
    expected: set[str],
    saved: set[str],
    strict: bool,
    is_module: bool,
    target: str = "the object it is loaded into",
) -> None:
    """With strict=True, a missing entry (and for a module an unexpected one) is an error that names it.

    `target` says in the message what `expected` describes (a pipeline passes the whole model its stages make up).
    """
    if not strict:
        return
    missing = sorted(expected - saved)
    unexpected = sorted(saved - expected) if is_module else []
    if missing or unexpected:
        parts = [f"missing {missing[:8]}" if missing else "", f"unexpected {unexpected[:8]}" if unexpected else ""]
        raise RuntimeError(
            f"load({path!r}): the checkpoint's {key!r} does not match {target}: "
            f"{', '.join(p for p in parts if p)}. Load into the object that was saved, or pass strict=False to "
            "skip missing and unexpected entries."
        )

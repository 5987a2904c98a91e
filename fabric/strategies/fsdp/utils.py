"""Helpers FSDPStrategy and ModelParallelStrategy share: meta init, optimizer rebinding, clipping.

torch.distributed.fsdp, .tensor and .checkpoint are imported inside the functions: `import fabric` must stay cheap.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module, Parameter
from torch.optim import Optimizer

from fabric.utilities.exceptions import FabricValueError


# -- modules --------------------------------------------------------------------------------------------
def check_has_parameters(module: Module, owner: str) -> None:
    """FSDP has nothing to shard in a module without parameters, and fails later with an obscure message."""
    if next(module.parameters(), None) is None:
        raise FabricValueError(
            f"{owner}.setup_module({type(module).__name__}): the module has no parameters, so there is nothing to "
            "shard. Set up a model that has parameters, or call this module directly without fabric.setup."
        )


def has_meta_tensors(module: Module) -> bool:
    """Whether the module was created under fabric.init_module(empty_init=True)."""
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def broadcast_module_states(module: Module) -> None:
    """Copy rank 0's parameters and buffers to every rank (before sharding)."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=0)


def materialize_meta_module(module: Module, device: torch.device) -> None:
    """Allocate a sharded meta-device module and initialise it with each submodule's `reset_parameters()`.

    Each sharded parameter is drawn in full, one submodule at a time, from an RNG seeded with rank 0's seed, and
    every rank keeps its own slice: replicas agree, shards differ as in an ordinary init, and the user's global
    RNG stream is left untouched. (Drawing on the shards directly would give every rank the same values on CPU,
    where DTensor has no distributed RNG.)
    """
    module.to_empty(device=device)
    seed = _rank_zero_seed()
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for submodule in module.modules():
            if callable(getattr(submodule, "reset_parameters", None)):
                _reset_in_full(submodule)


def _rank_zero_seed() -> int:
    holder = [torch.initial_seed()]
    if dist.is_initialized():
        dist.broadcast_object_list(holder, src=0)
    return int(holder[0])


def _reset_in_full(submodule: Module) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    sharded = {n: p for n, p in submodule.named_parameters(recurse=False) if isinstance(p, DTensor)}
    for name, param in sharded.items():
        local = param.to_local()
        full = torch.empty(param.shape, dtype=param.dtype, device=local.device)
        submodule._parameters[name] = Parameter(full, requires_grad=param.requires_grad)
    try:
        submodule.reset_parameters()  # type: ignore[operator]
        with torch.no_grad():
            for name, param in sharded.items():
                drawn = submodule._parameters[name]
                assert drawn is not None
                # src_data_rank=None: every rank holds the same full tensor, so each slices locally, no collective.
                mine = distribute_tensor(drawn.detach(), param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(mine.to_local())
    finally:
        for name, param in sharded.items():
            submodule._parameters[name] = param


def fsdp_modules(module: Module) -> list[Module]:
    """The submodules (root included) that fully_shard was applied to."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


@contextmanager
def gradient_sync_disabled(modules: list[Module]) -> Generator[None, None, None]:
    """FSDP2's no_sync: keep unsharded gradients locally; the next synced backward reduce-scatters their sum."""
    for fsdp_module in modules:
        fsdp_module.set_requires_gradient_sync(False, recurse=False)  # type: ignore[operator]
    try:
        yield
    finally:
        for fsdp_module in modules:
            fsdp_module.set_requires_gradient_sync(True, recurse=False)  # type: ignore[operator]


# -- optimizers -----------------------------------------------------------------------------------------
def parameter_names(module: Module) -> dict[int, str]:
    """id(parameter) -> name, taken before sharding replaces the parameter objects."""
    return {id(p): name for name, p in module.named_parameters()}


def rebind_optimizer(optimizer: Optimizer, names: dict[int, str], module: Module, owner: str) -> None:
    """Point an optimizer built on the unsharded parameters at the sharded ones that replaced them, by name."""
    if optimizer.state:
        raise RuntimeError(
            f"{owner}: fabric.setup(model, {type(optimizer).__name__}) got an optimizer that already has state, "
            "but sharding replaces the model's parameters, so that state would belong to parameters that no "
            "longer exist. Create the optimizer after sharding: model = fabric.setup_module(model), then "
            "optimizer = fabric.setup_optimizers(make_optimizer(model.parameters()))."
        )
    current = dict(module.named_parameters())
    for group in optimizer.param_groups:
        rebound = []
        for param in group["params"]:
            name = names.get(id(param))
            if name is None or name not in current:
                raise FabricValueError(
                    f"{owner}: fabric.setup(model, {type(optimizer).__name__}): the optimizer holds a parameter "
                    f"of shape {tuple(param.shape)} that is not in the model, so it cannot follow the model into "
                    "its sharded form. Build the optimizer from model.parameters() of the model being set up."
                )
            rebound.append(current[name])
        group["params"] = rebound


# -- gradients ------------------------------------------------------------------------------------------
def clip_grad_norm(parameters: Iterable[Tensor], max_norm: float, norm_type: float, error_if_nonfinite: bool) -> Tensor:
    """Clip by the global norm over all ranks' shards; returns that norm (a plain tensor, equal on every rank).

    Gradients on different device meshes (tensor-parallel layers next to data-parallel-only ones) cannot be
    combined in one DTensor op, so each mesh's norm is made whole first, then the norms are combined.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    by_mesh: dict[Any, list[Tensor]] = {}
    for grad in grads:
        by_mesh.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.tensor(0.0)
    device = norms[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"fabric.clip_gradients(max_norm={max_norm}): the total gradient norm is {total.item()}, so the "
            "gradients cannot be clipped. Look for inf/nan in the loss, or pass error_if_nonfinite=False."
        )
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for grad in grads:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            local.mul_(coefficient.to(local.device, local.dtype))
    return total


# -- state dicts ----------------------------------------------------------------------------------------
def module_state_dict(module: Module, full: bool) -> dict[str, Any]:
    """Sharded: DTensor values on every rank. Full: gathered on every rank, held on CPU by rank 0 only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=full, cpu_offload=full))


def optimizer_state_dict(module: Module, optimizer: Optimizer, full: bool) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, sharded or (rank 0 only) full."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=full, cpu_offload=full)
    return get_optimizer_state_dict(module, optimizer, options=options)

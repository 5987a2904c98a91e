"""fairscale's pieces as `ddp_sharded` uses them: the import, OSS from a plain optimizer, gradient buckets, checks.

Everything that names fairscale imports it here, inside a function: `import fabric` must not import fairscale.
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

from fabric.utilities.exceptions import FabricTypeError, FabricValueError

if TYPE_CHECKING:
    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim import OSS

INSTALL = 'pip install "torchfabric[fairscale]"'
# ShardedDataParallel's own arguments that fabric fills in: the model, the optimizers, the (world) process group.
_FILLED_IN = ("self", "module", "sharded_optimizer", "process_group")


def import_fairscale(what: str) -> ModuleType:
    """fairscale itself, or an error that says how to install it."""
    try:
        import fairscale
        import fairscale.nn.data_parallel
        import fairscale.optim
    except ImportError as err:
        raise ModuleNotFoundError(
            f"{what}: fairscale cannot be imported ({err}). Install it with {INSTALL}, or use strategy='fsdp' "
            "(torch's own sharding, maintained), which needs nothing extra."
        ) from None
    return fairscale


def check_sharded_ddp_kwargs(kwargs: dict[str, Any]) -> None:
    """Only ShardedDataParallel's own options may be passed through; DDP's (find_unused_parameters...) do not exist."""
    from fairscale.nn.data_parallel import ShardedDataParallel

    accepted = [name for name in inspect.signature(ShardedDataParallel.__init__).parameters if name not in _FILLED_IN]
    unknown = sorted(set(kwargs) - set(accepted))
    if "process_group" in kwargs:
        raise FabricValueError(
            "DDPShardedStrategy(process_group=...): the sharded optimizer and ShardedDataParallel must use the same "
            "group, and fabric joins all its processes in one. Leave process_group out."
        )
    if unknown:
        raise FabricTypeError(
            f"DDPShardedStrategy({', '.join(f'{name}=...' for name in unknown)}): fairscale's ShardedDataParallel "
            f"has no such option (DistributedDataParallel's options do not apply). It accepts: {', '.join(accepted)}."
        )


def check_optimizer_fits(module: Module, optimizer: Optimizer) -> None:
    """OSS shards the optimizer's parameters and ShardedDataParallel reduces the model's: they must be the same."""
    own = {id(param) for param in module.parameters()}
    foreign = sum(1 for group in optimizer.param_groups for param in group["params"] if id(param) not in own)
    if foreign:
        raise FabricValueError(
            f"fabric.setup({type(module).__name__}, {type(optimizer).__name__}): {foreign} of the optimizer's "
            "parameters do not belong to the model, so no rank would reduce their gradients. Create the optimizer "
            "from this model's parameters: optimizer = torch.optim.AdamW(model.parameters())."
        )


def to_oss(optimizer: Optimizer, broadcast_fp16: bool) -> OSS:
    """The user's optimizer as an OSS that shards it: the same class, defaults, parameter groups and state.

    The parameter group dicts are shared with the user's optimizer (torch keeps the dicts it is given), so an LR
    scheduler created on that optimizer before setup steers OSS: OSS copies its groups' values into the shard's
    optimizer at every step.
    """
    from fairscale.optim import OSS

    if isinstance(optimizer, OSS):
        # Made before fabric moved the model: partitions cached per device must be computed again.
        optimizer._clear_cache()
        return optimizer
    try:
        oss = OSS(params=optimizer.param_groups, optim=type(optimizer), **_constructor_defaults(optimizer))
    except TypeError as err:
        raise FabricTypeError(
            f"fabric.setup(model, {type(optimizer).__name__}): fairscale's OSS rebuilds the optimizer for each "
            f"shard as {type(optimizer).__name__}(params, **defaults), which failed ({err}). Create the "
            f"sharded optimizer yourself and pass it: OSS(model.parameters(), optim={type(optimizer).__name__}, "
            "...) from fairscale.optim."
        ) from None
    oss.broadcast_fp16 = broadcast_fp16
    if optimizer.state:
        # State loaded before setup (a resumed run) would be lost with the plain optimizer; OSS keeps its shard.
        oss.load_state_dict(optimizer.state_dict())
    return oss


def _constructor_defaults(optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor takes back.

    Some defaults are implied by the class, not arguments of it (torch's AdamW stores decoupled_weight_decay=True
    but does not accept it); the parameter groups OSS hands each shard still carry every value.
    """
    parameters = inspect.signature(type(optimizer).__init__).parameters.values()
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return dict(optimizer.defaults)
    names = {parameter.name for parameter in parameters}
    return {key: value for key, value in optimizer.defaults.items() if key in names}


def reject_fairscale_fsdp(module: Module) -> None:
    """fairscale's own FSDP cannot sit inside ShardedDataParallel, and without CUDA it cannot run at all."""
    from fairscale.nn import FullyShardedDataParallel

    if any(isinstance(sub, FullyShardedDataParallel) for sub in module.modules()):
        raise FabricTypeError(
            f"fabric.setup({type(module).__name__}) with strategy 'ddp_sharded': the model contains fairscale's "
            "FullyShardedDataParallel, which shards parameters itself (and needs CUDA streams: on the CPU its "
            "first forward fails). Pass the plain model, or use strategy='fsdp', torch's maintained successor of "
            "fairscale's FSDP."
        )


def fairscale_fsdp_requested(**_: Any) -> Any:
    """What the registry name `ddp_fully_sharded` (Lightning 1.x's name for fairscale's FSDP) builds: an error."""
    on_cpu = "" if torch.cuda.is_available() else " On this machine it cannot run at all: it needs CUDA streams."
    raise FabricValueError(
        "Fabric(strategy='ddp_fully_sharded'): fairscale's FullyShardedDataParallel is not offered; it is "
        f"unmaintained and was moved into torch as FSDP.{on_cpu} Use strategy='fsdp' (torch's FSDP2) to shard "
        "parameters, or 'ddp_sharded' for fairscale's sharded optimizer (OSS) with ShardedDataParallel."
    )


def reattach_bucket_grads(module: ShardedDataParallel) -> None:
    """Make every bucketed gradient a view of its bucket again, zero where the user set it to None.

    ShardedDataParallel packs small gradients into flat buckets (reduce_buffer_size > 0): `param.grad` is a view of
    the bucket, and the bucket, not `param.grad`, is what gets reduced to the rank that owns the parameter. torch 2's
    default `optimizer.zero_grad()` sets gradients to None, so the next backward writes fresh tensors outside the
    bucket: the owner steps with its local, unaveraged gradient while the stale bucket is reduced (weights drift
    from DDP from the second step on). Calling this before each backward restores the views, with the value None
    stands for (zero), or with the value the user assigned, so the reduction sees this step's gradients.
    """
    for bucket in module._bucket_list:
        offset = 0
        for param in bucket._params:
            count = param.numel()
            view = bucket.buffer[offset : offset + count].view_as(param)
            offset += count
            grad = param.grad
            if grad is not None and grad.data_ptr() == view.data_ptr():
                continue
            with torch.no_grad():
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad)
            param.grad = view


def consolidated_state(optimizer: OSS, rank: int) -> dict[str, Any]:
    """The whole optimizer state (torch's layout) on global rank 0, gathered from every shard; collective.

    Other ranks get an empty dict: only rank 0 writes the checkpoint, and holding every shard on each rank would
    cost the memory that sharding saved.
    """
    optimizer.consolidate_state_dict(recipient_rank=0)
    return _release_gathered(optimizer, optimizer.state_dict() if rank == 0 else {})


def gathered_state(optimizer: OSS) -> dict[str, Any]:
    """The whole optimizer state on every rank (what `optimizer.state_dict()` gives with DDP); collective."""
    return _release_gathered(optimizer, optimizer.state_dict(all_ranks=True))


def _release_gathered(optimizer: OSS, state: dict[str, Any]) -> dict[str, Any]:
    # OSS keeps the gathered shards until the next consolidation; the returned dict is their only user now, so the
    # memory is freed with it instead of staying held on the recipient for the rest of training.
    optimizer._all_states = []
    return state


def require_oss(optimizer: Optimizer, operation: str) -> OSS:
    """The OSS that fabric.setup made; a plain optimizer here was not set up with this strategy."""
    from fairscale.optim import OSS

    if not isinstance(optimizer, OSS):
        raise FabricTypeError(
            f"{operation} with {type(optimizer).__name__}: strategy 'ddp_sharded' needs the optimizer returned by "
            "fabric.setup(model, optimizer), which shards it with fairscale's OSS. Pass that optimizer."
        )
    return optimizer

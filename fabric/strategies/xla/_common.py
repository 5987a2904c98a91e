"""What the XLA strategies share: component checks, the device loader, collectives through torch_xla."""

from __future__ import annotations

import contextlib
import pickle
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from fabric.utilities.distributed import check_reduce_op
from fabric.utilities.exceptions import FabricTypeError, FabricValueError

if TYPE_CHECKING:
    from torch.nn import Module
    from torch.optim import Optimizer
    from torch.utils.data import DataLoader

    from fabric.accelerators.accelerator import Accelerator
    from fabric.precision.precision import Precision

# fabric's reduce_op names -> torch_xla's reduce types ("mean" is a sum divided afterwards).
_XLA_REDUCE = {"sum": "sum", "mean": "sum", "max": "max", "min": "min"}


def check_components(strategy: str, accelerator: Accelerator | None, precision: Precision | None) -> None:
    """XLA strategies run only on the XLA accelerator, with XLAPrecision (whose step goes through torch_xla)."""
    from fabric.accelerators.xla import XLAAccelerator
    from fabric.precision.xla import XLAPrecision

    if accelerator is not None and not isinstance(accelerator, XLAAccelerator):
        raise FabricValueError(
            f"Fabric(strategy={strategy!r}, accelerator={type(accelerator).__name__}): the XLA strategies run only "
            "on XLA devices. Pass accelerator='xla' (or 'tpu'), or choose a strategy for this hardware."
        )
    if precision is not None and not isinstance(precision, XLAPrecision):
        raise FabricTypeError(
            f"Fabric(strategy={strategy!r}, plugins=[{type(precision).__name__}]): the XLA strategies need "
            "XLAPrecision, whose optimizer step runs through torch_xla. Pass precision='bf16-mixed' (or another "
            "name), or plugins=[XLAPrecision(...)]."
        )


# Part of torch's assert when the autograd engine sized its per-device queues (at the first backward of the process)
# before the XLA devices existed; every later XLA backward fails with it.
_ENGINE_SIZED_TOO_EARLY = "device_ready_queues_"


@contextlib.contextmanager
def explain_early_backward() -> Iterator[None]:
    """Turn torch's bare internal assert of a backward that ran before the XLA runtime started into a clear error.

    The condition cannot be detected ahead at no cost (torch keeps no visible trace of its first backward), so it
    is explained where it fails, on XLA paths only; a successful backward pays for nothing but the `try`.
    """
    try:
        yield
    except RuntimeError as err:
        if _ENGINE_SIZED_TOO_EARLY not in str(err):
            raise
        raise RuntimeError(
            "fabric.backward() on an XLA device: torch's autograd engine cannot run it, because a backward already "
            "ran in this process before the XLA runtime started (torch sizes its per-device queues at the first "
            "backward of a process, so the XLA devices are missing from them). Create the Fabric, or start the "
            "XLA runtime (torch_xla.device()), before any backward in this process, for example before a CPU "
            "warm-up step or a check that calls .backward(); or run that code in another process."
        ) from err


class ParameterMoves:
    """Which device parameter replaced which CPU parameter when a module moved to an XLA device.

    Moving to XLA creates new Parameter objects (a CPU tensor cannot become an XLA tensor in place), so an optimizer
    created before `fabric.setup` would keep stepping the stale CPU parameters. Its references are swapped for the
    device ones when it is set up. Weak references: this record does not keep the CPU parameters alive.
    """

    def __init__(self) -> None:
        # Keyed by id: tensors compare elementwise, so they cannot be dictionary keys by value.
        self._moved: dict[int, tuple[weakref.ref[Tensor], Tensor]] = {}

    def move(self, module: Module, device: torch.device) -> None:
        """Move `module` to `device`, remembering each parameter's replacement."""
        before = dict(module.named_parameters(remove_duplicate=False))
        module.to(device)
        after = dict(module.named_parameters(remove_duplicate=False))
        for name, old in before.items():
            new = after.get(name)
            if new is not None and new is not old:
                self._moved[id(old)] = (weakref.ref(old), new)

    def update(self, optimizer: Optimizer) -> None:
        """Point the optimizer's parameter groups at the moved parameters."""
        for group in optimizer.param_groups:
            group["params"] = [self._replacement(p) for p in group["params"]]

    def _replacement(self, param: Tensor) -> Tensor:
        old, new = self._moved.get(id(param), (None, None))
        # The id may belong to a newer object if the old parameter was freed: check it is still the same one.
        return new if old is not None and new is not None and old() is param else param


def default_checkpoint_io(given: Any) -> Any:
    """XLACheckpointIO in place of the connector's default TorchCheckpointIO (as Lightning's XLA strategies have it).

    Any other plugin the user passed is kept: the XLA strategies hand it CPU tensors anyway.
    """
    from fabric.io.torch_io import TorchCheckpointIO
    from fabric.io.xla import XLACheckpointIO

    return XLACheckpointIO() if type(given) is TorchCheckpointIO else given


def device_loader(dataloader: DataLoader, device: torch.device) -> Any:
    """`dataloader` wrapped in torch_xla's MpDeviceLoader: batches arrive on `device`, loaded in the background.

    The wrapper answers `dataset`, `sampler`, `batch_sampler` and `num_workers` as the DataLoader does, so code
    (and fabric) that reads them keeps working.
    """
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    if isinstance(dataloader, MpDeviceLoader):
        return dataloader
    wrapped = MpDeviceLoader(dataloader, device)
    for name in ("dataset", "sampler", "batch_sampler", "num_workers", "batch_size"):
        setattr(wrapped, name, getattr(dataloader, name, None))
    return wrapped


def check_group(operation: str, group: Any) -> None:
    """torch_xla's collectives span every process; torch.distributed groups mean nothing to them."""
    if group is not None:
        raise FabricValueError(
            f"{operation}(group={group!r}): the XLA strategies reduce over all processes, and torch.distributed "
            "process groups do not apply to XLA collectives. Call it without group=."
        )


def all_reduce(tensor: Tensor, reduce_op: Any, device: torch.device, world_size: int) -> Tensor:
    """Reduce over all processes through `xm.all_reduce`; the result is on the tensor's device, the input unchanged."""
    import torch_xla.core.xla_model as xm

    op = check_reduce_op(reduce_op)
    original = tensor.device
    value = tensor.to(device)
    if op == "mean" and not torch.is_floating_point(value):
        value = value.float()
    result = cast(Tensor, xm.all_reduce(_XLA_REDUCE[op], value))
    if op == "mean":
        result = result / world_size
    return result.to(original)


def all_gather(tensor: Tensor, device: torch.device, sync_grads: bool) -> Tensor:
    """Stack every process's tensor along a new first dimension (as the other strategies do)."""
    if not isinstance(tensor, Tensor):
        raise FabricTypeError(
            f"all_gather({type(tensor).__name__}): the XLA strategies gather tensors only. Pass a tensor, or use "
            "fabric.broadcast for other objects."
        )
    original = tensor.device
    value = tensor.unsqueeze(0).to(device)
    if sync_grads:
        import torch_xla.core.functions as xf

        gathered = xf.all_gather(value)
    else:
        import torch_xla.core.xla_model as xm

        gathered = xm.all_gather(value)
    return gathered.to(original)


def broadcast(obj: Any, src: int, device: torch.device, rank: int) -> Any:
    """Tensors through `xm.collective_broadcast`; other objects pickled through a rendezvous (any size, any type)."""
    import torch_xla.core.xla_model as xm

    if isinstance(obj, Tensor):
        original = obj.device
        holder = [obj.to(device)]
        xm.collective_broadcast(holder, root_ordinal=src)
        return holder[0].to(original)
    # Every process sends bytes, only the source's are read: the others' sizes need not match, unlike a tensor's.
    payloads = xm.rendezvous("fabric-broadcast", pickle.dumps(obj) if rank == src else b"")
    return pickle.loads(payloads[src])


def barrier(name: str | None) -> None:
    """Every process waits at the rendezvous named `name`."""
    import torch_xla.core.xla_model as xm

    xm.rendezvous(name or "fabric-barrier")

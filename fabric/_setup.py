"""Checks and conversions behind Fabric's setup, launch and logging calls, kept out of the facade's file."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from torch import Tensor
from torch.optim import Optimizer

from fabric.utilities.apply_func import move_to_device
from fabric.utilities.exceptions import FabricTypeError, FabricValueError
from fabric.wrappers import is_wrapped

if TYPE_CHECKING:
    from fabric._dataloader import _FabricDataLoader
    from fabric.strategies.strategy import Strategy


def setup_dataloader(strategy: Strategy, loader: Any, use_sampler: bool, move: bool) -> _FabricDataLoader:
    """Shard (through the strategy), seed the workers and wrap one loader; batches move to the device."""
    from torch.utils.data import DataLoader

    from fabric._dataloader import _FabricDataLoader
    from fabric.utilities._loader_state import make_stateful
    from fabric.utilities.data import add_worker_init_fn
    from fabric.utilities.seed import current_seed_config

    if isinstance(loader, _FabricDataLoader):
        raise FabricValueError(
            "fabric.setup_dataloaders(): this DataLoader was already set up. Pass the original loader once."
        )
    if not isinstance(loader, DataLoader):
        raise FabricTypeError(
            f"fabric.setup_dataloaders({type(loader).__name__}): expected a torch.utils.data.DataLoader. "
            "Wrap your dataset in DataLoader(dataset, batch_size=...) first."
        )
    if use_sampler:
        loader = strategy.process_dataloader(loader)
    seed, seed_workers = current_seed_config()
    if seed_workers and seed is not None:
        loader = add_worker_init_fn(loader, rank=strategy.global_rank)
    # Last, so that the position it keeps covers the final sampler and workers (see docs/resume.md).
    loader = make_stateful(loader)
    root = strategy.root_device
    device = root if move and root.type != "cpu" else None
    move_fn = move_to_device if device is not None else None
    return _FabricDataLoader(loader, device, move_fn, rank=strategy.global_rank, world_size=strategy.world_size)


def check_scheduler(scheduler: Any, optimizers: tuple[Optimizer, ...], strategy: Strategy) -> None:
    """A scheduler needs its optimizer, and a strategy that can step it."""
    if not optimizers:
        raise FabricValueError(
            f"fabric.setup(model, scheduler={type(scheduler).__name__}): a scheduler needs its optimizer. "
            "Pass them together: fabric.setup(model, optimizer, scheduler=scheduler)."
        )
    if strategy.requires_joint_setup:
        raise FabricValueError(
            f"fabric.setup(..., scheduler={type(scheduler).__name__}): strategy {type(strategy).__name__} "
            "cannot drive an LR scheduler inside its engine in fabric. Leave scheduler= out and call "
            "scheduler.step() yourself after optimizer.step()."
        )


def check_not_wrapped(obj: Any, method: str) -> None:
    """Each model and optimizer is set up once."""
    if is_wrapped(obj):
        raise FabricValueError(
            f"fabric.{method}({type(obj).__name__}): this object was already set up by fabric. Set each "
            "model and optimizer up once, and keep using the object that setup returned."
        )


def scalar(name: str, value: Any) -> Any:
    """A logged tensor as a Python number; loggers store numbers, not tensors."""
    if not isinstance(value, Tensor):
        return value
    if value.numel() != 1:
        raise FabricValueError(
            f"fabric.log({name!r}, tensor of shape {list(value.shape)}): a metric must be one number, but this "
            f"tensor holds {value.numel()} values. Reduce it first, e.g. value.mean(), or log each element by name."
        )
    return value.item()


def as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, Iterable) and not isinstance(value, (str, bytes)) else [value]


def check_launch_function(function: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    if not callable(function):
        raise FabricTypeError(f"fabric.launch({function!r}): expected a function. Pass e.g. fabric.launch(train).")
    try:
        inspect.signature(function).bind(None, *args, **kwargs)
    except TypeError:
        name = getattr(function, "__name__", repr(function))
        raise FabricTypeError(
            f"fabric.launch({name}): {name}() must take the Fabric object as its first argument, followed by the "
            f"arguments given to launch. Define it as def {name}(fabric, ...)."
        ) from None
    except ValueError:  # builtins without a signature: nothing to check
        pass

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
    from torch.utils.data import DataLoader

    from fabric._dataloader import _FabricDataLoader
    from fabric.strategies.strategy import Strategy


def setup_dataloader(
    strategy: Strategy, loader: Any, use_sampler: bool, move: bool, even_batches: bool = True
) -> _FabricDataLoader:
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
    # Workers are seeded before the strategy sees the loader: a strategy may return a loader of another type
    # (torch_xla's MpDeviceLoader) that cannot be rebuilt with a worker_init_fn.
    seed, seed_workers = current_seed_config()
    if seed_workers and seed is not None:
        loader = add_worker_init_fn(loader, rank=strategy.global_rank)
    if not even_batches:
        loader = _exact_dataloader(strategy, loader, use_sampler)
    elif use_sampler:
        loader = strategy.process_dataloader(loader)
    # Last, so that the position it keeps covers the final sampler and workers (see docs/resume.md).
    loader = make_stateful(loader)
    root = strategy.root_device
    device = root if move and root.type != "cpu" else None
    move_fn = move_to_device if device is not None else None
    return _FabricDataLoader(loader, device, move_fn, rank=strategy.global_rank, world_size=strategy.world_size)


def _exact_dataloader(strategy: Strategy, loader: DataLoader, use_sampler: bool) -> DataLoader:
    """The strategy's loader that reads every sample on exactly one rank (even_batches=False)."""
    from fabric.utilities.exact_sampler import check_exact_possible

    if not use_sampler:
        raise FabricValueError(
            "fabric.setup_dataloaders(use_distributed_sampler=False, even_batches=False): even_batches=False asks "
            "fabric to shard the data without padding, but use_distributed_sampler=False tells it not to shard at "
            "all. Drop even_batches=False (your sampler decides), or drop use_distributed_sampler=False."
        )
    # Checked here as well as in the strategies, so that a script fails alike on one process and on many.
    check_exact_possible(loader, "fabric.setup_dataloaders")
    parameters = inspect.signature(strategy.process_dataloader).parameters
    takes_it = "even_batches" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    if not takes_it:
        name = type(strategy).__name__
        raise FabricTypeError(
            f"fabric.setup_dataloaders(even_batches=False): {name}.process_dataloader(dataloader) takes no "
            f"even_batches argument, so it cannot be asked to shard without padding. Add a keyword argument "
            f"`*, even_batches: bool = True` to {name}.process_dataloader and honour it, or keep even_batches=True."
        )
    return strategy.process_dataloader(loader, even_batches=False)


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

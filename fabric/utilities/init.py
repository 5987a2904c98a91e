"""Skipping weight initialisation when a model is built only to be loaded or sharded afterwards."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.overrides import TorchFunctionMode


class _EmptyInit(TorchFunctionMode):
    """Turns `torch.nn.init.*` calls into no-ops while enabled, so large models build quickly."""

    def __init__(self, enabled: bool = True) -> None:
        super().__init__()
        self.enabled = enabled

    def __enter__(self) -> Any:
        # A disabled mode must not be pushed at all: an active mode costs every torch call a detour.
        return super().__enter__() if self.enabled else self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            super().__exit__(*exc)

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            # Every in-place init function takes the tensor first and returns it.
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


# -- Lightning Fabric's meta-device helpers (fabric.utilities.init.*), which libraries import ----------------


def _has_meta_device_parameters_or_buffers(obj: Any, recurse: bool = True) -> bool:
    """Whether a module (its parameters or buffers) or an optimizer (its parameters) still lives on 'meta'."""
    import itertools

    from torch.nn import Module, Parameter
    from torch.optim import Optimizer

    from fabric.utilities.exceptions import FabricTypeError

    if isinstance(obj, Optimizer):
        params = (p for group in obj.param_groups for p in group["params"] if isinstance(p, Parameter))
        return any(p.is_meta for p in params)
    if isinstance(obj, Module):
        return any(t.is_meta for t in itertools.chain(obj.parameters(recurse=recurse), obj.buffers(recurse=recurse)))
    raise FabricTypeError(
        f"_has_meta_device_parameters_or_buffers({type(obj).__name__}): expected a torch.nn.Module or a "
        "torch.optim.Optimizer. Pass the model or the optimizer."
    )


def _materialize(module: Any, device: Any) -> None:
    """Allocate ``module``'s own (not its children's) meta tensors on ``device`` and re-initialise them."""
    from fabric.utilities.exceptions import FabricTypeError

    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        raise FabricTypeError(
            f"_materialize({type(module).__name__}): the module has no reset_parameters() method, so its "
            "parameters would keep uninitialised memory. Define reset_parameters() to initialise them."
        )
    module.to_empty(device=device, recurse=False)
    reset()


def _materialize_meta_tensors(module: Any, device: Any) -> None:
    """Materialise every submodule that holds meta tensors, each with its own ``reset_parameters()``."""
    for submodule in module.modules():
        if _has_meta_device_parameters_or_buffers(submodule, recurse=False):
            _materialize(submodule, device)


def _materialize_distributed_module(module: Any, device: Any) -> None:
    """Materialise a (sharded) meta-device module in place with ``reset_parameters()``; every process calls it.

    With a process group, the processes agree on rank 0's seed first, so replicated parameters match.
    """
    import torch

    from fabric.strategies.fsdp.utils import materialize_meta_module

    if _has_meta_device_parameters_or_buffers(module):
        materialize_meta_module(module, torch.device(device))

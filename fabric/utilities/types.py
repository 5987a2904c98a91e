"""Type aliases and structural protocols shared by fabric's signatures (Lightning's ``utilities.types`` names)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch import Tensor
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

_PATH = str | Path
_DEVICE = torch.device | str | int
_MAP_LOCATION_TYPE = (
    _DEVICE | Callable[[torch.UntypedStorage, str], torch.UntypedStorage | None] | dict[_DEVICE, _DEVICE] | None
)
_PARAMETERS = Iterator[torch.nn.Parameter]

if torch.distributed.is_available():
    from torch.distributed import ProcessGroup, ReduceOp

    RedOpType = ReduceOp.RedOpType
else:  # torch built without distributed support
    ProcessGroup = Any  # type: ignore[assignment,misc]
    ReduceOp = RedOpType = object  # type: ignore[assignment,misc]

_LRScheduler = LRScheduler
_TORCH_LRSCHEDULER = LRScheduler  # Lightning's older name, still imported by client code
_DictKey = TypeVar("_DictKey")


@runtime_checkable
class _Stateful(Protocol[_DictKey]):
    """Anything with ``state_dict`` and ``load_state_dict``, found with ``isinstance(obj, _Stateful)``."""

    def state_dict(self) -> dict[_DictKey, Any]: ...

    def load_state_dict(self, state_dict: dict[_DictKey, Any]) -> None: ...


@runtime_checkable
class CollectibleGroup(Protocol):
    """A process group: it has a size and this process's rank in it."""

    def size(self) -> int: ...

    def rank(self) -> int: ...


@runtime_checkable
class Steppable(Protocol):
    """Anything with ``step(closure=None)``, like an optimizer."""

    def step(self, closure: Callable[[], float] | None = ...) -> float | None: ...


@runtime_checkable
class Optimizable(Steppable, Protocol):
    """The parts of ``torch.optim.Optimizer`` fabric relies on."""

    param_groups: list[dict[Any, Any]]
    defaults: dict[Any, Any]
    state: defaultdict[Tensor, Any]

    def state_dict(self) -> dict[str, dict[Any, Any]]: ...

    def load_state_dict(self, state_dict: dict[str, dict[Any, Any]]) -> None: ...


__all__ = [
    "_DEVICE",
    "_MAP_LOCATION_TYPE",
    "_PARAMETERS",
    "_PATH",
    "CollectibleGroup",
    "LRScheduler",
    "Optimizable",
    "ProcessGroup",
    "RedOpType",
    "ReduceLROnPlateau",
    "ReduceOp",
    "Steppable",
    "_LRScheduler",
    "_Stateful",
]

"""Apply a function to every element of a type inside nested collections, and move batches to devices."""

from __future__ import annotations

import copy
import dataclasses
from abc import ABC
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

_DType = type | tuple[type, ...]
_MISSING = object()


def apply_to_collection(
    data: Any,
    dtype: _DType,
    function: Callable[..., Any],
    *args: Any,
    wrong_dtype: _DType | None = None,
    include_none: bool = True,
    **kwargs: Any,
) -> Any:
    """Call ``function(element, *args, **kwargs)`` on every element of type ``dtype`` inside ``data``.

    Mappings (keeping ``OrderedDict`` and ``defaultdict`` with its ``default_factory``), lists, tuples,
    namedtuples and dataclass instances (frozen ones and ``init=False`` fields included) are rebuilt with
    the results; anything else, sets included, is returned as is.

    Args:
        data: the collection, or a single element.
        dtype: the type(s) ``function`` is applied to.
        function: what to apply.
        *args: extra positional arguments for ``function``.
        wrong_dtype: type(s) that are never passed to ``function`` even when they match ``dtype``.
        include_none: whether ``None`` results stay in lists, tuples and mappings. Namedtuples and
            dataclasses cannot drop a field, so they keep the original element instead.
        **kwargs: extra keyword arguments for ``function``.
    """
    # The common call is on a single matching element; answer it without building the recursion state.
    if isinstance(data, dtype) and (wrong_dtype is None or not isinstance(data, wrong_dtype)):
        return function(data, *args, **kwargs)
    return _Applier(dtype, function, args, kwargs, wrong_dtype, include_none).apply(data)


class _Applier:
    """Holds the arguments of one ``apply_to_collection`` call so the recursion passes only the data."""

    def __init__(
        self,
        dtype: _DType,
        function: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        wrong_dtype: _DType | None,
        include_none: bool,
    ) -> None:
        self._dtype = dtype
        self._function = function
        self._args = args
        self._kwargs = kwargs
        self._wrong_dtype = wrong_dtype
        self._include_none = include_none

    def apply(self, data: Any) -> Any:
        if isinstance(data, self._dtype) and (self._wrong_dtype is None or not isinstance(data, self._wrong_dtype)):
            return self._function(data, *self._args, **self._kwargs)
        if isinstance(data, Mapping):
            return self._apply_mapping(data)
        if _is_namedtuple(data):
            return type(data)(*(self._apply_fixed(item) for item in data))
        if isinstance(data, (list, tuple)):
            return type(data)(self._apply_items(data))
        if dataclasses.is_dataclass(data) and not isinstance(data, type):
            return self._apply_dataclass(data)
        return data

    def _apply_items(self, items: list[Any] | tuple[Any, ...]) -> list[Any]:
        out = []
        for item in items:
            value = self.apply(item)
            if value is not None or self._include_none:
                out.append(value)
        return out

    def _apply_fixed(self, item: Any) -> Any:
        value = self.apply(item)
        return item if value is None and not self._include_none else value

    def _apply_mapping(self, data: Mapping[Any, Any]) -> Mapping[Any, Any]:
        out = {}
        for key, item in data.items():
            value = self.apply(item)
            if value is not None or self._include_none:
                out[key] = value
        if isinstance(data, defaultdict):
            return type(data)(data.default_factory, out)
        return type(data)(out)  # type: ignore[call-arg]

    def _apply_dataclass(self, data: Any) -> Any:
        # A shallow copy plus object.__setattr__ instead of dataclasses.replace: replace re-runs __init__
        # and __post_init__, cannot pass init=False fields, and frozen instances reject plain setattr.
        result = copy.copy(data)
        for field in dataclasses.fields(data):
            original = getattr(data, field.name, _MISSING)
            if original is _MISSING:  # an init=False field without a default that was never assigned
                continue
            object.__setattr__(result, field.name, self._apply_fixed(original))
        return result


def _is_namedtuple(data: Any) -> bool:
    return isinstance(data, tuple) and hasattr(data, "_fields") and hasattr(data, "_asdict")


# An ABC rather than a runtime Protocol: ABC isinstance results are cached per class, which keeps
# move_to_device cheap on every batch.
class _TransferableDataType(ABC):  # noqa: B024
    """Any object whose class has a callable ``to`` attribute, such as a tensor or a user's batch class."""

    @classmethod
    def __subclasshook__(cls, subclass: type) -> bool:
        if cls is _TransferableDataType:
            return callable(getattr(subclass, "to", None))
        return NotImplemented


class _NumpyValue(ABC):  # noqa: B024
    """A numpy array or scalar, recognised without importing numpy."""

    @classmethod
    def __subclasshook__(cls, subclass: type) -> bool:
        if cls is _NumpyValue:
            return getattr(subclass, "__module__", None) == "numpy" and hasattr(subclass, "__array__")
        return NotImplemented


def move_to_device(obj: Any, device: torch.device | str | int) -> Any:
    """Move every tensor, and every object with a ``to`` method, inside ``obj`` to ``device``."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    # Hot paths: a bare tensor, or a list or tuple of tensors (`for x, y in loader`), the batches of nearly every
    # loop, need none of the collection machinery (it costs about 3 us per batch).
    if isinstance(obj, Tensor):
        return _move(obj, device)
    if type(obj) is tuple or type(obj) is list:
        moved = _move_tensors(obj, device)
        if moved is not None:
            return moved
    return apply_to_collection(obj, _TransferableDataType, _move, device)


def _move_tensors(items: list[Any] | tuple[Any, ...], device: torch.device) -> Any:
    """`items` with every tensor moved, or None when an item is anything but a plain tensor."""
    if device.type == "cuda":  # asynchronous host-to-CUDA copies, as `_move` makes them
        return None if any(type(item) is not Tensor for item in items) else type(items)(_move(t, device) for t in items)
    moved = []
    for item in items:
        if type(item) is not Tensor:
            return None
        moved.append(item.to(device))
    return type(items)(moved)


def _move(data: Any, device: torch.device) -> Any:
    # non_blocking only pays off for host-to-CUDA copies; on other devices it can return before the data
    # is ready.
    if isinstance(data, Tensor) and device.type == "cuda":
        return data.to(device, non_blocking=True)
    moved = data.to(device)
    # A user's `to` written to move in place may return None; the object itself is then the result.
    return data if moved is None else moved


def convert_to_tensors(data: Any, device: torch.device) -> Any:
    """Turn python numbers and numpy values inside ``data`` into tensors on ``device``; move tensors there."""
    return apply_to_collection(data, (Tensor, bool, int, float, _NumpyValue), _to_tensor, device)


def _to_tensor(value: Any, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        # Collectives and serialisation need contiguous memory, so normalise that here once.
        return value.to(device).contiguous()
    if isinstance(value, _NumpyValue):
        # The copy makes the tensor independent of the caller's array and handles negative strides,
        # which torch cannot wrap directly.
        return torch.as_tensor(value.copy(), device=device)  # type: ignore[attr-defined]
    return torch.tensor(value, device=device)


# -- Lightning Fabric's names for the helpers above (fabric.utilities.apply_func.*) -----------------------


def move_data_to_device(batch: Any, device: torch.device | str | int) -> Any:
    """Move every tensor, and every object with a ``to`` method, inside ``batch`` to ``device`` (Lightning's name)."""
    return move_to_device(batch, device)


def convert_tensors_to_scalars(data: Any) -> Any:
    """Replace every one-element tensor inside ``data`` by its Python number; larger tensors raise ValueError."""

    def to_scalar(tensor: Tensor) -> int | float | bool:
        if tensor.numel() != 1:
            raise ValueError(
                f"convert_tensors_to_scalars: a tensor of shape {tuple(tensor.shape)} has {tensor.numel()} "
                "elements, so it is not one number. Reduce it (e.g. .mean()) before converting."
            )
        return tensor.item()

    return apply_to_collection(data, Tensor, to_scalar)

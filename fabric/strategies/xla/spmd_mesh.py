"""The xla_spmd mesh and sharding plan: checked as plain Python values, turned into torch_xla objects on demand.

torch_xla is imported only inside the functions that build its objects, so a bad mesh or plan is reported from
`Fabric(...)` without starting the XLA runtime.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from torch import Tensor

from fabric.utilities.exceptions import FabricTypeError, FabricValueError

if TYPE_CHECKING:
    from torch_xla.distributed.spmd import Mesh

# The axes the strategy knows the meaning of: the batch is split along "data" and "fsdp", parameters not named in
# the plan are sharded along "fsdp" (FSDPv2), and "model" is free for the tensor-parallel plan.
AXES = ("data", "fsdp", "model")
BATCH_AXES = ("data", "fsdp")
# Axis names for a mesh given by shape alone, by its number of dimensions.
_DEFAULT_NAMES = {1: ("fsdp",), 2: ("fsdp", "model"), 3: ("data", "fsdp", "model")}

# One entry per tensor dimension: the mesh axis (or axes) it is split along, or None to keep it whole.
PartitionSpec = tuple[str | tuple[str, ...] | None, ...]


def axis_names_for(mesh_shape: tuple[int, ...] | None, axis_names: Iterable[str] | None, owner: str) -> tuple[str, ...]:
    """The mesh's axis names: the given ones (checked), else the defaults for the shape's length."""
    if axis_names is None:
        length = 2 if mesh_shape is None else len(mesh_shape)
        if length not in _DEFAULT_NAMES:
            raise FabricValueError(
                f"{owner}(mesh_shape={mesh_shape}): a mesh has at most 3 axes ({', '.join(AXES)}). Pass a shape "
                "with 1 to 3 sizes, such as (4, 1)."
            )
        return _DEFAULT_NAMES[length]
    if isinstance(axis_names, str) or not isinstance(axis_names, Iterable):
        raise FabricTypeError(
            f"{owner}(axis_names={axis_names!r}): expected a tuple of axis names such as ('fsdp', 'model')."
        )
    names = tuple(axis_names)
    unknown = [name for name in names if name not in AXES]
    if unknown or not names or len(set(names)) != len(names):
        raise FabricValueError(
            f"{owner}(axis_names={names}): each axis must be one of {', '.join(AXES)}, named once, because the "
            "strategy shards batches along 'data'/'fsdp' and parameters along 'fsdp'. Rename the axes, "
            "e.g. ('fsdp', 'model')."
        )
    if mesh_shape is not None and len(mesh_shape) != len(names):
        raise FabricValueError(
            f"{owner}(mesh_shape={mesh_shape}, axis_names={names}): {len(mesh_shape)} sizes but {len(names)} "
            "names. Give one name per mesh dimension."
        )
    return names


def check_shape(mesh_shape: Any, owner: str) -> tuple[int, ...] | None:
    """A tuple of positive sizes, at most one of them -1 (the rest of the devices); None: the default."""
    if mesh_shape is None:
        return None
    sizes = tuple(mesh_shape) if isinstance(mesh_shape, (tuple, list)) else None
    if not sizes or not all(type(s) is int and (s > 0 or s == -1) for s in sizes) or sizes.count(-1) > 1:
        raise FabricValueError(
            f"{owner}(mesh_shape={mesh_shape!r}): expected a tuple of positive device counts, one per mesh axis "
            "(at most one -1 for 'the remaining devices'), such as (4, 1)."
        )
    return sizes


def resolve_shape(
    mesh_shape: tuple[int, ...] | None, names: tuple[str, ...], devices: int, owner: str
) -> tuple[int, ...]:
    """The mesh's sizes for `devices` devices: all of them on the first axis by default; -1 filled in."""
    if mesh_shape is None:
        return (devices,) + (1,) * (len(names) - 1)
    known = 1
    for size in mesh_shape:
        known *= size if size != -1 else 1
    shape = tuple(devices // known if size == -1 else size for size in mesh_shape)
    product = 1
    for size in shape:
        product *= size
    if product != devices:
        raise FabricValueError(
            f"{owner}(mesh_shape={mesh_shape}): the mesh has {product if -1 not in mesh_shape else 'no whole'} "
            f"devices, but this host has {devices} XLA devices, and xla_spmd drives all of them as one mesh. "
            f"Choose sizes whose product is {devices}, such as ({devices}, 1)."
        )
    return shape


def check_plan(plan: Any, names: tuple[str, ...], owner: str) -> dict[str, PartitionSpec]:
    """The sharding plan, {parameter-name pattern: partition spec}, with every axis it names in the mesh."""
    if plan is None:
        return {}
    if not isinstance(plan, Mapping):
        raise FabricTypeError(
            f"{owner}(sharding_plan={type(plan).__name__}): expected a dict from parameter-name patterns to "
            "partition specs, such as {'*.attn.q.weight': ('model', None)}."
        )
    checked: dict[str, PartitionSpec] = {}
    for pattern, spec in plan.items():
        if not isinstance(pattern, str) or not isinstance(spec, (tuple, list)):
            raise FabricTypeError(
                f"{owner}(sharding_plan={{{pattern!r}: {spec!r}}}): each entry maps a name pattern (str) to a "
                "tuple with one mesh axis (or None, or a tuple of axes) per dimension, such as ('model', None)."
            )
        used = [axis for entry in spec for axis in _axes_of(entry, pattern, spec, owner)]
        unknown = sorted({axis for axis in used if axis not in names})
        if unknown:
            raise FabricValueError(
                f"{owner}(sharding_plan={{{pattern!r}: {tuple(spec)}}}): axis {', '.join(map(repr, unknown))} is "
                f"not an axis of the mesh {names}. Use the mesh's axis names, or add the axis to axis_names."
            )
        if len(set(used)) != len(used):
            raise FabricValueError(
                f"{owner}(sharding_plan={{{pattern!r}: {tuple(spec)}}}): a mesh axis is used for two dimensions; a "
                "tensor can be split along each axis once. Name each axis at most once."
            )
        checked[pattern] = tuple(tuple(e) if isinstance(e, list) else e for e in spec)
    return checked


def _axes_of(entry: Any, pattern: str, spec: Any, owner: str) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, (tuple, list)) and all(isinstance(axis, str) for axis in entry):
        return tuple(entry)
    raise FabricTypeError(
        f"{owner}(sharding_plan={{{pattern!r}: {spec!r}}}): {entry!r} is not a mesh axis. Each dimension takes an "
        "axis name, a tuple of axis names, or None."
    )


def match_plan(
    plan: Mapping[str, PartitionSpec], parameters: Iterable[tuple[str, Tensor]], owner: str
) -> dict[str, PartitionSpec]:
    """{parameter name: spec} for the parameters the plan names; every pattern must match, and fit, a parameter."""
    params = list(parameters)
    chosen: dict[str, PartitionSpec] = {}
    owners: dict[str, str] = {}
    for pattern, spec in plan.items():
        matched = [(name, p) for name, p in params if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            sample = ", ".join(name for name, _ in params[:6]) + (", ..." if len(params) > 6 else "")
            raise FabricValueError(
                f"{owner}(sharding_plan={{{pattern!r}: ...}}): the pattern matches no parameter of the model "
                f"(its parameters are named like: {sample}). Fix the pattern (fnmatch syntax, e.g. "
                "'layers.*.weight') or remove the entry."
            )
        for name, param in matched:
            if name in owners:
                raise FabricValueError(
                    f"{owner}(sharding_plan): parameter {name!r} matches both {owners[name]!r} and {pattern!r}. "
                    "Make the patterns disjoint so that each parameter has one partition spec."
                )
            if len(spec) != param.dim():
                raise FabricValueError(
                    f"{owner}(sharding_plan={{{pattern!r}: {spec}}}): parameter {name!r} has {param.dim()} "
                    f"dimensions (shape {list(param.shape)}), but the spec has {len(spec)} entries. Give one entry "
                    "per dimension."
                )
            owners[name] = pattern
            chosen[name] = spec
    return chosen


def batch_spec(names: tuple[str, ...], ndim: int) -> PartitionSpec | None:
    """How a batch tensor is split: dimension 0 along the mesh's batch axes; None if there are none or no dims."""
    axes = tuple(name for name in names if name in BATCH_AXES)
    if not axes or ndim == 0:
        return None
    first: str | tuple[str, ...] = axes[0] if len(axes) == 1 else axes
    return (first,) + (None,) * (ndim - 1)


def build_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    """The torch_xla mesh over every device of this host, in device-id order."""
    import numpy as np
    import torch_xla.distributed.spmd as xs

    count = 1
    for size in shape:
        count *= size
    return xs.Mesh(np.arange(count), shape, names)

"""Pipeline stages cut from the user's model by submodule names, without tracing: which modules each stage keeps.

A split point names the submodule where a new stage begins. Every module that holds a split point further down
(the root, a `blocks` ModuleList, ...) is *cut*: its children are spread over the stages in the order it registers
them. Every other module is *whole*: it belongs to exactly one stage. Each stage is then the model with the whole
modules of the other stages removed (deleted from an nn.Sequential, nn.ModuleList or nn.ModuleDict; set to None
elsewhere), so parameter names stay those of the whole model, and checkpoints with them.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from fabric.utilities.exceptions import FabricTypeError, FabricValueError

# Containers whose forward (or, for ModuleList and ModuleDict, whose meaning) is "run the children in order", so a
# child of another stage can be deleted rather than set to None.
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)

MODEL_SHAPES = (
    "an nn.Sequential, an nn.ModuleList or nn.ModuleDict of blocks (run in order), or a model whose forward runs "
    "its submodules in the order it registers them and skips a submodule that is None (e.g. `h = self.embed(x) if "
    "self.embed is not None else x`; `for block in self.blocks: h = block(h)`)"
)


@dataclass(frozen=True)
class StagePlan:
    """Which whole modules each stage keeps (in run order) and which modules are cut across stages."""

    stages: tuple[tuple[str, ...], ...]
    cut: frozenset[str]  # fully qualified names of the cut modules; "" is the root


def check_split_points(split_points: object, owner: str) -> tuple[str, ...]:
    """A list of distinct submodule names (checked when the strategy is created, before any model is seen)."""
    if isinstance(split_points, str) or not isinstance(split_points, Sequence):
        raise FabricTypeError(
            f"{owner}(split_points={split_points!r}): expected a list of submodule names where a new stage begins, "
            "e.g. split_points=['layers.4']."
        )
    points = tuple(split_points)
    bad = [p for p in points if not isinstance(p, str) or not p]
    if bad:
        raise FabricTypeError(
            f"{owner}(split_points={list(points)!r}): {bad[0]!r} is not a submodule name. Pass the fully qualified "
            "names of submodules as model.named_modules() gives them, e.g. 'layers.4'."
        )
    if len(set(points)) != len(points):
        raise FabricValueError(
            f"{owner}(split_points={list(points)!r}): a name appears twice, which would make an empty stage. Name "
            "each submodule where a stage begins once."
        )
    return points


def plan_stages(model: nn.Module, split_points: tuple[str, ...], owner: str) -> StagePlan:
    """Cut `model` at `split_points` into len(split_points) + 1 stages, or say why it cannot be cut there."""
    known = dict(model.named_modules())
    for point in split_points:
        if point not in known:
            raise _no_such_submodule(model, point, split_points, known, owner)
    cut = frozenset(prefix for point in split_points for prefix in _ancestors(point))
    nested = [p for p in split_points if p in cut]
    if nested:
        raise FabricValueError(
            f"{owner}(split_points={list(split_points)!r}): {nested[0]!r} contains another split point, so it "
            "cannot begin a stage as a whole. Name only the innermost submodules where stages begin."
        )
    units = _whole_modules(model, "", cut)
    positions = [units.index(point) for point in split_points]
    if positions[:1] == [0] or positions != sorted(positions):
        raise FabricValueError(
            f"{owner}(split_points={list(split_points)!r}): split points must follow the order in which the model "
            f"registers (and runs) its submodules, and none may be the first one ({units[0]!r}), or a stage would "
            f"be empty. The order here is: {_shorten(units)}."
        )
    bounds = [0, *positions, len(units)]
    stages = tuple(tuple(units[bounds[i] : bounds[i + 1]]) for i in range(len(bounds) - 1))
    _check_cut_modules_hold_no_parameters(model, cut, split_points, owner)
    _check_no_shared_parameters(model, stages, owner)
    return StagePlan(stages, cut)


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts))]


def _whole_modules(module: nn.Module, prefix: str, cut: frozenset[str]) -> list[str]:
    """The names of the whole modules under a cut module, in registration order."""
    names: list[str] = []
    for name, child in module._modules.items():
        if child is None:
            continue
        full = f"{prefix}{name}"
        names.extend(_whole_modules(child, f"{full}.", cut) if full in cut else [full])
    return names


def _no_such_submodule(
    model: nn.Module, point: str, split_points: tuple[str, ...], known: dict[str, nn.Module], owner: str
) -> FabricValueError:
    names = [name for name in known if name]
    close = difflib.get_close_matches(point, names, n=3)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    listed = _shorten(names) if names else f"none: {type(model).__name__} has no submodules to split between"
    return FabricValueError(
        f"{owner}(split_points={list(split_points)!r}): the model ({type(model).__name__}) has no submodule "
        f"{point!r}.{hint} A split point is a name from model.named_modules(); the model's are: {listed}."
    )


def _shorten(names: list[str], keep: int = 12) -> str:
    shown = ", ".join(names[:keep])
    return shown + (f", ... ({len(names) - keep} more)" if len(names) > keep else "")


def _check_cut_modules_hold_no_parameters(
    model: nn.Module, cut: frozenset[str], split_points: tuple[str, ...], owner: str
) -> None:
    """A parameter held directly by a cut module belongs to no one stage (buffers are copied to every stage)."""
    modules = dict(model.named_modules())
    for name in sorted(cut):
        own = [n for n, p in modules[name]._parameters.items() if p is not None]
        if own:
            where = f"{name}.{own[0]}" if name else own[0]
            raise FabricValueError(
                f"{owner}(split_points={list(split_points)!r}): the parameter {where!r} belongs to "
                f"{name or 'the model itself'} ({type(modules[name]).__name__}), which is split across stages, so "
                "no one stage can own it. Stages keep whole submodules: move it into a submodule (such as an "
                "nn.Embedding or a small nn.Module) that runs in one stage."
            )


def _check_no_shared_parameters(model: nn.Module, stages: tuple[tuple[str, ...], ...], owner: str) -> None:
    """Tied weights across stages would be two copies on two processes, updated apart: refuse them."""
    modules = dict(model.named_modules())
    owner_of: dict[int, tuple[int, str]] = {}
    for index, names in enumerate(stages):
        for name in names:
            for param_name, param in modules[name].named_parameters():
                seen = owner_of.setdefault(id(param), (index, f"{name}.{param_name}"))
                if seen[0] != index:
                    raise FabricValueError(
                        f"{owner}: the parameter {seen[1]!r} (stage {seen[0]}) is the same tensor as "
                        f"{name}.{param_name!s} (stage {index}): tied weights cannot be split between pipeline "
                        "stages, which run on different processes. Untie them, or choose split points that keep "
                        "both modules in one stage."
                    )


def prune(
    module: nn.Module, keep: set[str], cut: frozenset[str], prefix: str = "", in_place: bool = False
) -> nn.Module:
    """`module` with only the whole modules in `keep`; cut modules are copied (sharing their kept children) unless
    `in_place`, so that several stages can be cut from one model, and the model itself left to its owner."""
    target = module if in_place else _shell(module)
    for name, child in list(module._modules.items()):
        if child is None:
            continue
        full = f"{prefix}{name}"
        if full in cut and any(k == full or k.startswith(f"{full}.") for k in keep):
            target._modules[name] = prune(child, keep, cut, f"{full}.", in_place)
        elif full not in keep:
            _drop(target, name)
    return target


def _shell(module: nn.Module) -> nn.Module:
    """A copy of a module object whose submodule, parameter, buffer and hook tables are its own."""
    shell = object.__new__(type(module))
    shell.__dict__ = dict(module.__dict__)
    for table in ("_modules", "_parameters", "_buffers", "_forward_pre_hooks", "_forward_hooks"):
        if table in shell.__dict__:
            shell.__dict__[table] = type(module.__dict__[table])(module.__dict__[table])
    return shell


def _drop(module: nn.Module, name: str) -> None:
    # A container runs what it holds, so the entry goes; another module keeps the attribute, as None, so that its
    # forward can tell the submodule runs in another stage. Other entries keep their names (and so their keys).
    if isinstance(module, _CONTAINERS):
        del module._modules[name]
    else:
        module._modules[name] = None

"""Import aliasing for running a library written for Lightning Fabric on fabric without editing it.

After ``install()``, every import of ``lightning.fabric`` or ``lightning_fabric`` (and their submodules) resolves to
fabric's module at the same path, and ``lightning.Fabric`` / ``lightning.seed_everything`` are fabric's. The rest of
``lightning`` (``lightning.pytorch``: ``LightningDataModule``, ``isolate_rng``, loggers) stays the installed one:
it is imported first, bound to Lightning's own fabric, because it uses private internals of it.

Aliased modules are fabric's module objects themselves, not copies, so ``isinstance`` checks and module state are
shared between ``lightning.fabric.x`` and ``fabric.x``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

_PREFIXES = ("lightning.fabric", "lightning_fabric")


def _target(name: str) -> str | None:
    for prefix in _PREFIXES:
        if name == prefix or name.startswith(prefix + "."):
            return "fabric" + name[len(prefix) :]
    return None


class _AliasLoader(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if _target(name) is None:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        real = importlib.import_module(_target(spec.name) or "")
        # importlib overwrites __spec__ with the alias's spec after this returns; keep the real one to put back.
        spec.loader_state = real.__spec__
        return real

    def exec_module(self, module: ModuleType) -> None:
        spec = module.__spec__
        if spec is not None and spec.loader_state is not None:
            module.__spec__ = spec.loader_state


def install() -> None:
    import lightning  # the whole package (lightning.pytorch included), bound to Lightning's own fabric
    import lightning.pytorch.utilities.seed

    import fabric

    for name in [name for name in sys.modules if _target(name) is not None]:
        del sys.modules[name]  # Lightning's modules stay alive through lightning.pytorch's references
    sys.meta_path.insert(0, _AliasLoader())
    lightning.fabric = importlib.import_module("lightning.fabric")  # type: ignore[attr-defined]
    lightning.Fabric = fabric.Fabric  # type: ignore[attr-defined]
    lightning.seed_everything = fabric.seed_everything  # type: ignore[attr-defined]

"""Names a package exports but imports on first use (PEP 562).

`import fabric` would otherwise import every strategy, precision and logger module, though a run uses one of
each: the DeepSpeed, FSDP, XLA, fairscale and pipeline strategies alone were about 40% of fabric's own import
time. Their packages (deepspeed, torch_xla, ...) were already imported on use; this defers fabric's own modules too.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from typing import Any


def exports(package: str, lazy: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of `package`, which exports each name in `lazy` from the module it maps to.

    A name is imported when first read (`package.Name` or `from package import Name`), then kept in the
    package's namespace, so later reads are plain attribute reads. `package` may also be a plain module. Of a
    package, a submodule it no longer imports itself is imported when read as an attribute
    (`fabric.strategies.deepspeed.DeepSpeedStrategy` after `import fabric`), as when the package imported it.
    """

    def __getattr__(name: str) -> Any:
        module = lazy.get(name)
        if module is None:
            is_package = "__path__" in vars(sys.modules[package])  # not hasattr: that would call this again
            if is_package and not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
                return importlib.import_module(f"{package}.{name}")
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(lazy))

    return __getattr__, __dir__

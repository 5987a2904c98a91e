"""Name -> factory registries for accelerators and strategies; user classes register like built-ins.

Names are case-insensitive ("DDP" finds "ddp"), as Lightning Fabric's strategy names are: they are stored and
listed in lower case. A factory may also be given as the text "package.module:Name", imported when the name is
first asked for: that is how fabric registers the strategies a run may never use (DeepSpeed, FSDP, XLA, ...),
so that `import fabric` does not import them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

from fabric.utilities.exceptions import FabricValueError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps a name to a factory plus default keyword arguments."""

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._entries: dict[str, tuple[Callable[..., T] | str, dict[str, Any], str]] = {}

    def register(
        self,
        name: str,
        factory: Callable[..., T] | str,
        description: str = "",
        override: bool = False,
        **init_kwargs: Any,
    ) -> None:
        """Register `factory(**init_kwargs, **components)` under `name` (case-insensitive).

        `factory` is a class or callable, or the text "package.module:Name" of one, imported when `name` is first
        looked up (`get`, `factory_of`).
        """
        if isinstance(factory, str):
            _check_path(factory)
        name = _key(name)
        if name in self._entries and not override:
            raise FabricValueError(
                f"register({name!r}): this {self._kind} name is already registered. "
                "Pick another name or pass override=True to replace it."
            )
        self._entries[name] = (factory, init_kwargs, description)

    def remove(self, name: str) -> None:
        """Forget `name`."""
        self._entries.pop(_key(name), None)

    def get(self, name: str) -> tuple[Callable[..., T], dict[str, Any]]:
        """Return the factory and its default keyword arguments."""
        _, kwargs, _ = self._entries[_key(name)]
        return self.factory_of(name), dict(kwargs)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and _key(name) in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def names(self) -> list[str]:
        """All registered names (lower case), in registration order."""
        return list(self._entries)

    # Lightning's names for `names()` on its strategy and accelerator registries.
    def available_strategies(self) -> list[str]:
        """All registered names (Lightning's name on the strategy registry)."""
        return self.names()

    def available_accelerators(self) -> list[str]:
        """All registered names (Lightning's name on the accelerator registry)."""
        return self.names()

    def factory_of(self, name: str) -> Callable[..., T]:
        """The class or callable registered under `name` (imported now if it was registered by its path)."""
        key = _key(name)
        factory, kwargs, description = self._entries[key]
        if isinstance(factory, str):
            factory = _resolve(factory, f"{self._kind} {key!r}")
            self._entries[key] = (factory, kwargs, description)  # imported once
        return factory


def _key(name: str) -> str:
    return name.lower()


def _check_path(path: str) -> None:
    module, _, attribute = path.partition(":")
    if not module or not attribute.isidentifier():
        raise FabricValueError(
            f"register(factory={path!r}): a factory given as text must name a module and an attribute in it, as "
            "'package.module:Name'. Pass the class itself, or its path in that form."
        )


def _resolve(path: str, what: str) -> Callable[..., Any]:
    """Import the factory named "package.module:Name", registered as `what`."""
    module, _, attribute = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as err:
        raise FabricValueError(
            f"The {what} is registered as {path!r}, which cannot be imported: {err}. Fix the path given to "
            "register(), or register the class itself."
        ) from err


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """ " Did you mean 'x'?" with the choice closest to a misspelt `name`, or "" when none is close.

    Closest: fewest edits (a swap of two neighbours counts as one, the commonest typo), then the same length (a
    typo replaces or swaps letters more often than it drops one: 'dpp' is 'ddp', not 'dp'), then registration order.
    """
    name = name.lower()
    limit = max(1, len(name) // 3)
    ranked = sorted(
        (_edits(name, choice), abs(len(choice) - len(name)), index, choice) for index, choice in enumerate(choices)
    )
    if not ranked or ranked[0][0] > limit:
        return ""
    return f" Did you mean {ranked[0][3]!r}?"


def _edits(a: str, b: str) -> int:
    """Insertions, deletions, substitutions and swaps of neighbours that turn `a` into `b` (Damerau-Levenshtein,
    optimal string alignment)."""
    previous2: list[int] = []
    previous = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        current = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                current[j] = min(current[j], previous2[j - 2] + 1)
        previous2, previous = previous, current
    return previous[len(b)]

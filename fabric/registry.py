"""Name -> factory registries for accelerators and strategies; user classes register like built-ins."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from fabric.utilities.exceptions import FabricValueError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps a name to a factory plus default keyword arguments."""

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._entries: dict[str, tuple[Callable[..., T], dict[str, Any], str]] = {}

    def register(
        self,
        name: str,
        factory: Callable[..., T],
        description: str = "",
        override: bool = False,
        **init_kwargs: Any,
    ) -> None:
        """Register `factory(**init_kwargs, **components)` under `name`."""
        if name in self._entries and not override:
            raise FabricValueError(
                f"register({name!r}): this {self._kind} name is already registered. "
                "Pick another name or pass override=True to replace it."
            )
        self._entries[name] = (factory, init_kwargs, description)

    def remove(self, name: str) -> None:
        """Forget `name`."""
        self._entries.pop(name, None)

    def get(self, name: str) -> tuple[Callable[..., T], dict[str, Any]]:
        """Return the factory and its default keyword arguments."""
        factory, kwargs, _ = self._entries[name]
        return factory, dict(kwargs)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def names(self) -> list[str]:
        """All registered names, in registration order."""
        return list(self._entries)

    def factory_of(self, name: str) -> Callable[..., T]:
        """The class or callable registered under `name`."""
        return self._entries[name][0]

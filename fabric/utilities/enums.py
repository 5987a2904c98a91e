"""``LightningEnum``: a string enum whose members equal their value, compared case-insensitively."""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from fabric.utilities.exceptions import FabricValueError


class LightningEnum(str, Enum):
    """A ``str`` enum: ``Color.RED == "red"`` and ``== "RED"``; members hash like their lower-cased value."""

    @classmethod
    def from_str(cls, value: str, source: Literal["key", "value", "any"] = "key") -> LightningEnum:
        """The member whose name (``source="key"``), value (``"value"``) or either (``"any"``) is ``value``."""
        wanted = value.lower()
        for member in cls:
            if source in ("key", "any") and member.name.lower() == wanted:
                return member
            if source in ("value", "any") and member.value.lower() == wanted:
                return member
        names = ", ".join(m.name if source == "key" else m.value for m in cls)
        raise FabricValueError(f"{cls.__name__}.from_str({value!r}, source={source!r}): no such member. Use one of: "
                               f"{names}.")  # fmt: skip

    def __eq__(self, other: object) -> bool:
        other_value = other.value if isinstance(other, Enum) else other
        return isinstance(other_value, str) and self.value.lower() == other_value.lower()

    def __hash__(self) -> int:
        # Equal objects must hash alike: members equal their value in any case, so hash the lower case.
        return hash(self.value.lower())

    def __str__(self) -> str:
        return str(self.value)

    @staticmethod
    def _generate_next_value_(name: str, start: int, count: int, last_values: list[Any]) -> str:
        return name.lower()


__all__ = ["LightningEnum"]

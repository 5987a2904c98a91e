"""The Launcher role: how the processes come to exist. It never knows what they run."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any


class Launcher(ABC):
    """Starts the worker processes and runs a function in each."""

    @property
    @abstractmethod
    def is_interactive_compatible(self) -> bool:
        """Whether it works from a notebook or a REPL."""

    @property
    @abstractmethod
    def continues_script(self) -> bool:
        """True if every process continues the user's script after `launch()` (no function needed)."""

    @abstractmethod
    def launch(self, function: Callable[..., Any], *args: Any) -> Any:
        """Start the processes, run `function(*args)` in each, and return this process's result (rank 0's)."""

"""The Accelerator role: hardware only (is it there, which devices, prepare a device)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class Accelerator(ABC):
    """Knows one kind of hardware; knows nothing about strategies or processes."""

    name: str = ""

    @staticmethod
    @abstractmethod
    def is_available() -> bool:
        """Whether this hardware can be used in this process."""

    @staticmethod
    @abstractmethod
    def auto_device_count() -> int:
        """How many devices `devices="auto"` means on this machine."""

    @staticmethod
    @abstractmethod
    def parse_devices(devices: Any) -> list[int]:
        """Turn the `devices` flag into a list of device indices (raises on bad input)."""

    @staticmethod
    @abstractmethod
    def get_parallel_devices(indices: list[int]) -> list[torch.device]:
        """The torch devices for the given indices."""

    @abstractmethod
    def setup_device(self, device: torch.device) -> None:
        """Make `device` current for this process."""

    def teardown(self) -> None:  # noqa: B027 - optional hook, most hardware needs nothing
        """Release what `setup_device` took."""

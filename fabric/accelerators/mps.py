"""MPS accelerator: Apple silicon GPUs."""

from __future__ import annotations

from typing import Any

import torch

from fabric.accelerators._devices import parse_device_indices
from fabric.accelerators.accelerator import Accelerator
from fabric.utilities.exceptions import FabricValueError


class MPSAccelerator(Accelerator):
    """The single Apple GPU."""

    name = "mps"

    @staticmethod
    def is_available() -> bool:
        """Whether torch was built with MPS and the machine has it."""
        return bool(torch.backends.mps.is_available())

    @staticmethod
    def auto_device_count() -> int:
        """There is at most one MPS device."""
        return 1 if MPSAccelerator.is_available() else 0

    @staticmethod
    def parse_devices(devices: Any) -> list[int]:
        """Only `1`, `[0]` or `auto` can work."""
        return parse_device_indices(devices, MPSAccelerator.auto_device_count(), "MPS")

    @staticmethod
    def get_parallel_devices(indices: list[int]) -> list[torch.device]:
        """The MPS device."""
        return [torch.device("mps", i) for i in indices]

    def setup_device(self, device: torch.device) -> None:
        """Nothing to select: there is one MPS device."""
        if device.type != "mps":
            raise FabricValueError(
                f"MPSAccelerator.setup_device({device}): not an MPS device. Pass torch.device('mps')."
            )

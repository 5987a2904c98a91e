"""CPU accelerator: `devices` counts processes, each using the CPU."""

from __future__ import annotations

import os
from typing import Any

import torch

from fabric.accelerators._devices import _bad
from fabric.accelerators.accelerator import Accelerator
from fabric.utilities.exceptions import FabricValueError


class CPUAccelerator(Accelerator):
    """Runs on the CPU; `devices=N` means N processes."""

    name = "cpu"

    @staticmethod
    def is_available() -> bool:
        """The CPU is always there."""
        return True

    @staticmethod
    def auto_device_count() -> int:
        """One process: several CPU processes only help when asked for."""
        return 1

    @staticmethod
    def parse_devices(devices: Any) -> list[int]:
        """`devices` is a process count; -1 means one per core."""
        if devices == "auto":
            return [0]
        if devices in (-1, "-1"):
            return list(range(os.cpu_count() or 1))
        count = devices
        if isinstance(devices, str) and devices.strip().isdigit():
            count = int(devices)
        if isinstance(count, bool) or not isinstance(count, int):
            raise _bad(
                devices,
                "on the CPU, devices is the number of processes",
                "Pass a positive int such as 2 (device indices only exist on GPUs).",
            )
        if count <= 0:
            raise _bad(
                devices,
                "the number of CPU processes must be positive",
                "Pass 1 or more, or -1 for one per core.",
            )
        return list(range(count))

    @staticmethod
    def get_parallel_devices(indices: list[int]) -> list[torch.device]:
        """Every process uses the same CPU device."""
        return [torch.device("cpu")] * len(indices)

    def setup_device(self, device: torch.device) -> None:
        """Nothing to prepare on the CPU."""
        if device.type != "cpu":
            raise FabricValueError(
                f"CPUAccelerator.setup_device({device}): not a CPU device. Use a CUDA/MPS accelerator."
            )

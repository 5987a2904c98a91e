"""CUDA accelerator: NVIDIA GPUs through torch.cuda."""

from __future__ import annotations

from typing import Any

import torch

from fabric.accelerators._devices import parse_device_indices
from fabric.accelerators.accelerator import Accelerator
from fabric.utilities.exceptions import FabricValueError


def _cuda_count() -> int:
    # torch.cuda.device_count() reads NVML without initialising CUDA, so forking stays safe afterwards.
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class CUDAAccelerator(Accelerator):
    """NVIDIA GPUs; `devices` selects GPU indices."""

    name = "cuda"

    @staticmethod
    def is_available() -> bool:
        """At least one CUDA device is visible."""
        return _cuda_count() > 0

    @staticmethod
    def auto_device_count() -> int:
        """All visible GPUs."""
        return _cuda_count()

    @staticmethod
    def parse_devices(devices: Any) -> list[int]:
        """Indices of the GPUs to use."""
        return parse_device_indices(devices, _cuda_count(), "CUDA")

    @staticmethod
    def get_parallel_devices(indices: list[int]) -> list[torch.device]:
        """One `cuda:i` device per index."""
        return [torch.device("cuda", i) for i in indices]

    def setup_device(self, device: torch.device) -> None:
        """Make `device` this process's current GPU."""
        if device.type != "cuda":
            raise FabricValueError(
                f"CUDAAccelerator.setup_device({device}): not a CUDA device. Pass a 'cuda:N' device."
            )
        torch.cuda.set_device(device)

    def teardown(self) -> None:
        """Hand cached blocks back so a following Fabric in this process starts clean."""
        torch.cuda.empty_cache()

"""CUDA accelerator: NVIDIA GPUs through torch.cuda."""

from __future__ import annotations

from typing import Any

import torch

from fabric.accelerators._devices import parse_device_indices
from fabric.accelerators.accelerator import Accelerator
from fabric.accelerators.cuda_devices import find_usable_cuda_devices as find_usable_cuda_devices  # Lightning's path
from fabric.utilities.exceptions import FabricValueError


def _cuda_count() -> int:
    # device_count() asks NVML and leaves the CUDA driver untouched, so ddp_fork can still fork afterwards;
    # is_available() would initialise the driver unless PYTORCH_NVML_BASED_CUDA_CHECK=1 (set on `import fabric`,
    # but a user may have set it to 0). It returns 0 on a CPU-only build of torch.
    return torch.cuda.device_count()


def num_cuda_devices() -> int:
    """How many CUDA devices this process sees (0 without CUDA); asks NVML, so the driver stays uninitialised."""
    return _cuda_count()


def is_cuda_available() -> bool:
    """Whether any CUDA device is visible, without initialising the driver (so ddp_fork can still fork)."""
    return _cuda_count() > 0


def check_bf16_supported(device: torch.device, precision: str) -> None:
    """Refuse bfloat16 on a GPU that cannot run it; call it only where CUDA may be initialised (after launch)."""
    if device.type != "cuda" or torch.cuda.is_bf16_supported():
        return
    raise FabricValueError(
        f"Fabric(precision={precision!r}): the GPU {device} ({torch.cuda.get_device_name(device)}) does not support "
        "bfloat16. Use precision='16-mixed' (float16 with loss scaling) or '32-true'."
    )


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

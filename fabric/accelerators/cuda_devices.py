"""find_usable_cuda_devices: the GPUs this process can actually allocate on (others may be taken exclusively)."""

from __future__ import annotations

import torch

from fabric.utilities.exceptions import FabricValueError


def find_usable_cuda_devices(num_devices: int = -1) -> list[int]:
    """The indices of the first ``num_devices`` visible GPUs that accept a tensor (-1: all usable ones).

    A GPU in 'exclusive process' compute mode that another process occupies refuses allocations; pass the
    result as ``Fabric(devices=...)`` to skip such GPUs. Two processes calling this at once may pick the
    same free GPU, so call it once per job.
    """
    if num_devices == 0:
        return []
    if num_devices < -1:
        raise FabricValueError(
            f"find_usable_cuda_devices(num_devices={num_devices}): a negative count other than -1 has no meaning. "
            "Pass -1 for every usable GPU, or a positive count."
        )
    visible = torch.cuda.device_count()
    if visible == 0:
        raise FabricValueError(
            f"find_usable_cuda_devices(num_devices={num_devices}): no CUDA device is visible on this machine. "
            "Check CUDA_VISIBLE_DEVICES and the driver, or run on CPU."
        )
    if num_devices > visible:
        raise FabricValueError(
            f"find_usable_cuda_devices(num_devices={num_devices}): only {visible} CUDA device(s) are visible. "
            f"Ask for at most {visible}."
        )
    usable: list[int] = []
    for index in range(visible):
        if _accepts_tensor(index):
            usable.append(index)
            if len(usable) == num_devices:
                break
    if num_devices != -1 and len(usable) < num_devices:
        raise RuntimeError(
            f"find_usable_cuda_devices(num_devices={num_devices}): only {len(usable)} of the {visible} visible GPUs "
            f"accept allocations ({usable}); the others are occupied or failing. Ask for fewer, or free them."
        )
    return usable


def _accepts_tensor(index: int) -> bool:
    try:
        torch.tensor(0, device=torch.device("cuda", index))
    except RuntimeError:
        return False
    return True

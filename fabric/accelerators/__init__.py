"""Accelerators (hardware only) and their registry."""

from fabric.accelerators.accelerator import Accelerator
from fabric.accelerators.cpu import CPUAccelerator
from fabric.accelerators.cuda import CUDAAccelerator
from fabric.accelerators.cuda_devices import find_usable_cuda_devices
from fabric.accelerators.mps import MPSAccelerator
from fabric.accelerators.xla import XLAAccelerator
from fabric.registry import Registry

ACCELERATOR_REGISTRY: Registry[Accelerator] = Registry("accelerator")
ACCELERATOR_REGISTRY.register("cpu", CPUAccelerator, "The CPU")
ACCELERATOR_REGISTRY.register("cuda", CUDAAccelerator, "NVIDIA GPUs")
ACCELERATOR_REGISTRY.register("mps", MPSAccelerator, "Apple silicon GPU")
ACCELERATOR_REGISTRY.register("xla", XLAAccelerator, "XLA devices via torch_xla (TPU; CPU with PJRT_DEVICE=CPU)")
ACCELERATOR_REGISTRY.register("tpu", XLAAccelerator, "TPUs through torch_xla (same as 'xla')")

__all__ = [
    "ACCELERATOR_REGISTRY",
    "Accelerator",
    "CPUAccelerator",
    "CUDAAccelerator",
    "MPSAccelerator",
    "XLAAccelerator",
    "find_usable_cuda_devices",
]

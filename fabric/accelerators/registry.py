"""Lightning Fabric's import path ``accelerators.registry`` (a re-export)."""

from fabric.accelerators import ACCELERATOR_REGISTRY
from fabric.registry import Registry as _AcceleratorRegistry

__all__ = ["ACCELERATOR_REGISTRY", "_AcceleratorRegistry"]

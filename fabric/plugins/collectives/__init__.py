"""Lightning Fabric's import path ``plugins.collectives`` (a re-export)."""

from fabric.collectives import Collective, SingleDeviceCollective, TorchCollective

__all__ = ["Collective", "SingleDeviceCollective", "TorchCollective"]

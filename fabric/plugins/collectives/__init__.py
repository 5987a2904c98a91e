"""Lightning Fabric's ``plugins.collectives`` import path: a re-export of fabric.collectives."""

from fabric.collectives import Collective, SingleDeviceCollective, TorchCollective

__all__ = ["Collective", "SingleDeviceCollective", "TorchCollective"]

"""Lightning Fabric's import path ``plugins.collectives.single_device`` (a re-export)."""

from fabric.collectives.single_device import SingleDeviceCollective

__all__ = ["SingleDeviceCollective"]

"""Lightning Fabric's import path ``strategies.single_xla`` (a re-export of fabric.strategies.xla)."""

from fabric.strategies.xla.single import SingleDeviceXLAStrategy

__all__ = ["SingleDeviceXLAStrategy"]

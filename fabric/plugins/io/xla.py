"""Lightning Fabric's import path ``plugins.io.xla`` (a re-export)."""

from fabric.io.xla import XLACheckpointIO

__all__ = ["XLACheckpointIO"]

"""Lightning Fabric's import path ``plugins.io`` (a re-export)."""

from fabric.io import AsyncCheckpointIO, CheckpointIO, TorchCheckpointIO, XLACheckpointIO

__all__ = ["AsyncCheckpointIO", "CheckpointIO", "TorchCheckpointIO", "XLACheckpointIO"]

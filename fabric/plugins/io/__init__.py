"""Lightning Fabric's import path ``plugins.io`` (a re-export)."""

from fabric.io import CheckpointIO, TorchCheckpointIO

__all__ = ["CheckpointIO", "TorchCheckpointIO"]

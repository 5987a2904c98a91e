"""Lightning Fabric's ``plugins.io`` import path: a re-export of fabric.io."""

from fabric.io import CheckpointIO, TorchCheckpointIO

__all__ = ["CheckpointIO", "TorchCheckpointIO"]

"""Checkpoint input and output plugins."""

from fabric.io.checkpoint_io import CheckpointIO
from fabric.io.torch_io import TorchCheckpointIO

__all__ = ["CheckpointIO", "TorchCheckpointIO"]

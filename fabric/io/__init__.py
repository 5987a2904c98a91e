"""Checkpoint input and output plugins."""

from fabric.io._load import UnsafeCheckpointError
from fabric.io.checkpoint_io import CheckpointIO
from fabric.io.torch_io import TorchCheckpointIO

__all__ = ["CheckpointIO", "TorchCheckpointIO", "UnsafeCheckpointError"]

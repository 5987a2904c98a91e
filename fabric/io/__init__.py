"""Checkpoint input and output plugins."""

from fabric.io._load import UnsafeCheckpointError
from fabric.io.async_io import AsyncCheckpointIO
from fabric.io.checkpoint_io import CheckpointIO
from fabric.io.torch_io import TorchCheckpointIO
from fabric.io.xla import XLACheckpointIO

__all__ = ["AsyncCheckpointIO", "CheckpointIO", "TorchCheckpointIO", "UnsafeCheckpointError", "XLACheckpointIO"]

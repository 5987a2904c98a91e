"""Lightning Fabric's import path ``plugins.io.torch_io`` (a re-export)."""

from fabric.io.torch_io import TorchCheckpointIO

__all__ = ["TorchCheckpointIO"]

"""Lightning Fabric's import path ``plugins.io.checkpoint_io`` (a re-export)."""

from fabric.io.checkpoint_io import CheckpointIO

__all__ = ["CheckpointIO"]

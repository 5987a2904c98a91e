"""Lightning Fabric's import path ``plugins.collectives.torch_collective`` (a re-export)."""

from fabric.collectives.torch_collective import TorchCollective

__all__ = ["TorchCollective"]

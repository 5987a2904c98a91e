"""Lightning Fabric's import path ``plugins.collectives.torch_collective`` (a re-export)."""

from torch.distributed.constants import default_pg_timeout

from fabric.collectives.torch_collective import TorchCollective

__all__ = ["TorchCollective", "default_pg_timeout"]

"""fabric: scale a raw PyTorch training loop to many processes, devices and nodes with a few lines."""

import os
from typing import TYPE_CHECKING

from fabric import _lazy
from fabric.accelerators import (
    ACCELERATOR_REGISTRY,
    Accelerator,
    CPUAccelerator,
    CUDAAccelerator,
    MPSAccelerator,
)
from fabric.environments import (
    ClusterEnvironment,
    DefaultEnvironment,
    KubeflowEnvironment,
    LightningEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    ProcessGroupEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from fabric.fabric import Fabric
from fabric.io import AsyncCheckpointIO, CheckpointIO, TorchCheckpointIO
from fabric.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from fabric.strategies import STRATEGY_REGISTRY, DDPStrategy, ParallelStrategy, SingleDeviceStrategy, Strategy
from fabric.utilities.seed import seed_everything
from fabric.wrappers import is_wrapped

if TYPE_CHECKING:
    from fabric.precision import BitsandbytesPrecision, DeepSpeedPrecision, FSDPPrecision, TransformerEnginePrecision
    from fabric.strategies import DataParallelStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

# Imported on first use, through the subpackages that export them lazily too (fabric/_lazy.py): a run needs at
# most one strategy of these.
_FROM_PRECISION = ("BitsandbytesPrecision", "DeepSpeedPrecision", "FSDPPrecision", "TransformerEnginePrecision")
_FROM_STRATEGIES = ("DataParallelStrategy", "DeepSpeedStrategy", "FSDPStrategy", "ModelParallelStrategy")
__getattr__, __dir__ = _lazy.exports(
    __name__,
    {**dict.fromkeys(_FROM_PRECISION, "fabric.precision"), **dict.fromkeys(_FROM_STRATEGIES, "fabric.strategies")},
)

# Without this, torch.cuda.is_available() initialises the CUDA driver in the calling process, and a process that
# later forks (ddp_fork, ddp_notebook) can no longer use CUDA in its children. With it, torch counts devices
# through NVML, which leaves the driver untouched. Lightning sets it on import too; a user's own value wins.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

__version__ = "0.1.0"

__all__ = [
    "ACCELERATOR_REGISTRY",
    "STRATEGY_REGISTRY",
    "Accelerator",
    "AsyncCheckpointIO",
    "BitsandbytesPrecision",
    "CPUAccelerator",
    "CUDAAccelerator",
    "CheckpointIO",
    "ClusterEnvironment",
    "DDPStrategy",
    "DataParallelStrategy",
    "DeepSpeedPrecision",
    "DeepSpeedStrategy",
    "DefaultEnvironment",
    "DoublePrecision",
    "FSDPPrecision",
    "FSDPStrategy",
    "Fabric",
    "HalfPrecision",
    "KubeflowEnvironment",
    "LSFEnvironment",
    "LightningEnvironment",
    "MPIEnvironment",
    "MPSAccelerator",
    "MixedPrecision",
    "ModelParallelStrategy",
    "ParallelStrategy",
    "Precision",
    "ProcessGroupEnvironment",
    "SLURMEnvironment",
    "SingleDeviceStrategy",
    "Strategy",
    "TorchCheckpointIO",
    "TorchElasticEnvironment",
    "TransformerEnginePrecision",
    "is_wrapped",
    "seed_everything",
]

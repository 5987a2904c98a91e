"""fabric: scale a raw PyTorch training loop to many processes, devices and nodes with a few lines."""

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
from fabric.strategies import (
    STRATEGY_REGISTRY,
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    ParallelStrategy,
    SingleDeviceStrategy,
    Strategy,
)
from fabric.utilities.seed import seed_everything

__version__ = "0.1.0"

__all__ = [
    "ACCELERATOR_REGISTRY",
    "STRATEGY_REGISTRY",
    "Accelerator",
    "AsyncCheckpointIO",
    "CPUAccelerator",
    "CUDAAccelerator",
    "CheckpointIO",
    "ClusterEnvironment",
    "DDPStrategy",
    "DeepSpeedStrategy",
    "DefaultEnvironment",
    "DoublePrecision",
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
    "seed_everything",
]

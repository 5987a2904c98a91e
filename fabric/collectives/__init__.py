"""Collectives usable without a Fabric: tensor communication over torch.distributed, or within one process."""

from fabric.collectives.collective import Collective
from fabric.collectives.single_device import SingleDeviceCollective
from fabric.collectives.torch_collective import TorchCollective

__all__ = ["Collective", "SingleDeviceCollective", "TorchCollective"]

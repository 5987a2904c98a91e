"""The XLA strategy family: `single_xla`, `xla` (one process per device), `xla_fsdp` (torch_xla's FSDP v1) and
`xla_spmd` (one process, every device of the host as an SPMD mesh)."""

from fabric.checkpoint.xla_fsdp import consolidate_xla_fsdp_checkpoint
from fabric.strategies.xla.ddp import XLAStrategy
from fabric.strategies.xla.fsdp import XLAFSDPStrategy
from fabric.strategies.xla.single import SingleDeviceXLAStrategy
from fabric.strategies.xla.spmd import XLASPMDStrategy

__all__ = [
    "SingleDeviceXLAStrategy",
    "XLAFSDPStrategy",
    "XLASPMDStrategy",
    "XLAStrategy",
    "consolidate_xla_fsdp_checkpoint",
]

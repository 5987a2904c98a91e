"""The XLA strategy family: `single_xla`, `xla` (one process per device) and `xla_fsdp` (torch_xla's FSDP v1)."""

from fabric.checkpoint.xla_fsdp import consolidate_xla_fsdp_checkpoint
from fabric.strategies.xla.ddp import XLAStrategy
from fabric.strategies.xla.fsdp import XLAFSDPStrategy
from fabric.strategies.xla.single import SingleDeviceXLAStrategy

__all__ = ["SingleDeviceXLAStrategy", "XLAFSDPStrategy", "XLAStrategy", "consolidate_xla_fsdp_checkpoint"]

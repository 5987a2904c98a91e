"""Lightning Fabric's import path ``strategies.xla_fsdp`` (a re-export of fabric.strategies.xla)."""

from fabric.strategies.xla.fsdp import XLAFSDPStrategy

__all__ = ["XLAFSDPStrategy"]

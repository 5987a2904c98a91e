"""The XLA family: strategies for TPUs (and any PJRT device) through torch_xla, imported only when used."""

from fabric.strategies.xla.spmd import XLASPMDStrategy

__all__ = ["XLASPMDStrategy"]

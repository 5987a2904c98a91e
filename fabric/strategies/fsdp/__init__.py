"""Fully sharded data parallel (FSDP2): the strategy, the base it shares with ModelParallelStrategy, helpers."""

from fabric.strategies.fsdp.strategy import FSDPStrategy

__all__ = ["FSDPStrategy"]

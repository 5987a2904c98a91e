"""Lightning Fabric's import path ``strategies.registry`` (a re-export)."""

from fabric.registry import Registry as _StrategyRegistry
from fabric.strategies import STRATEGY_REGISTRY

__all__ = ["STRATEGY_REGISTRY", "_StrategyRegistry"]

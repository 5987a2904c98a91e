"""Strategies (all distributed behaviour) and their registry."""

from fabric.registry import Registry
from fabric.strategies.ddp import DDPStrategy
from fabric.strategies.parallel import ParallelStrategy
from fabric.strategies.single_device import SingleDeviceStrategy
from fabric.strategies.strategy import Strategy

STRATEGY_REGISTRY: Registry[Strategy] = Registry("strategy")
STRATEGY_REGISTRY.register("single_device", SingleDeviceStrategy, "One process on one device")
_DDP_LAUNCHES = {
    "ddp": ("popen", "re-runs your script for local ranks 1..N-1"),
    "ddp_spawn": ("spawn", "starts fresh processes that run the function given to launch()"),
    "ddp_fork": ("fork", "forks processes that run the function given to launch()"),
    "ddp_notebook": ("fork", "ddp_fork, for notebooks"),
}
for _name, (_method, _what) in _DDP_LAUNCHES.items():
    STRATEGY_REGISTRY.register(_name, DDPStrategy, f"DDP that {_what}", start_method=_method)
    for _flag in (True, False):
        STRATEGY_REGISTRY.register(
            f"{_name}_find_unused_parameters_{str(_flag).lower()}",
            DDPStrategy,
            f"{_name} with find_unused_parameters={_flag}",
            start_method=_method,
            find_unused_parameters=_flag,
        )

__all__ = ["STRATEGY_REGISTRY", "DDPStrategy", "ParallelStrategy", "SingleDeviceStrategy", "Strategy"]

"""Strategies (all distributed behaviour) and their registry.

The strategies a run rarely needs are imported on first use, by the registry or by reading their name here
(fabric._lazy): `import fabric` does not import DeepSpeed's, FSDP's, XLA's, fairscale's or the pipeline's modules.
"""

from typing import TYPE_CHECKING

from fabric import _lazy
from fabric.registry import Registry
from fabric.strategies.ddp import DDPStrategy
from fabric.strategies.parallel import ParallelStrategy
from fabric.strategies.single_device import SingleDeviceStrategy
from fabric.strategies.strategy import Strategy

if TYPE_CHECKING:
    from fabric.strategies.deepspeed import DeepSpeedStrategy
    from fabric.strategies.dp import DataParallelStrategy
    from fabric.strategies.fairscale import DDPShardedStrategy
    from fabric.strategies.fsdp import FSDPStrategy
    from fabric.strategies.model_parallel import ModelParallelStrategy
    from fabric.strategies.pipeline import PipelineStrategy
    from fabric.strategies.xla import SingleDeviceXLAStrategy, XLAFSDPStrategy, XLASPMDStrategy, XLAStrategy

_LAZY = {
    "DeepSpeedStrategy": "fabric.strategies.deepspeed",
    "DataParallelStrategy": "fabric.strategies.dp",
    "DDPShardedStrategy": "fabric.strategies.fairscale",
    "FSDPStrategy": "fabric.strategies.fsdp",
    "ModelParallelStrategy": "fabric.strategies.model_parallel",
    "PipelineStrategy": "fabric.strategies.pipeline",
    "SingleDeviceXLAStrategy": "fabric.strategies.xla",
    "XLAFSDPStrategy": "fabric.strategies.xla",
    "XLASPMDStrategy": "fabric.strategies.xla",
    "XLAStrategy": "fabric.strategies.xla",
}
__getattr__, __dir__ = _lazy.exports(__name__, _LAZY)


def _path(name: str) -> str:
    """The registry's text for a lazily exported class: imported when its name is first asked for."""
    return f"{_LAZY[name]}:{name}"


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
STRATEGY_REGISTRY.register(
    "dp", _path("DataParallelStrategy"), "DataParallel: one process, the model replicated over its GPUs"
)
STRATEGY_REGISTRY.register(
    "fsdp", _path("FSDPStrategy"), "FSDP2 (fully_shard): parameters, gradients, optimizer state sharded"
)
STRATEGY_REGISTRY.register(
    "xla_spmd", _path("XLASPMDStrategy"), "One process drives every XLA device of the host as an SPMD mesh"
)
STRATEGY_REGISTRY.register(
    "fsdp_cpu_offload", _path("FSDPStrategy"), "fsdp with shards kept in CPU memory", cpu_offload=True
)

_DEEPSPEED_VARIANTS: dict[str, tuple[str, dict]] = {
    "deepspeed": ("DeepSpeed ZeRO stage 2 (optimizer state and gradients sharded)", {}),
    "deepspeed_stage_1": ("DeepSpeed ZeRO stage 1: optimizer state sharded", {"stage": 1}),
    "deepspeed_stage_2": ("DeepSpeed ZeRO stage 2: optimizer state and gradients sharded", {"stage": 2}),
    "deepspeed_stage_2_offload": ("deepspeed_stage_2 with the optimizer in CPU memory",
                                  {"stage": 2, "offload_optimizer": True}),
    "deepspeed_stage_3": ("DeepSpeed ZeRO stage 3: parameters sharded too", {"stage": 3}),
    "deepspeed_stage_3_offload": ("deepspeed_stage_3 with parameters and optimizer in CPU memory",
                                  {"stage": 3, "offload_optimizer": True, "offload_parameters": True}),
}  # fmt: skip
for _name, (_what, _kwargs) in _DEEPSPEED_VARIANTS.items():
    STRATEGY_REGISTRY.register(_name, _path("DeepSpeedStrategy"), _what, **_kwargs)
# Lightning Fabric 1.9's names for fairscale (legacy, `torchfabric[fairscale]`); fairscale is imported on use.
STRATEGY_REGISTRY.register("ddp_sharded", _path("DDPShardedStrategy"), "fairscale OSS + ShardedDataParallel (legacy)")
STRATEGY_REGISTRY.register(
    "ddp_sharded_spawn", _path("DDPShardedStrategy"), "ddp_sharded with spawned processes", start_method="spawn"
)
# Lightning 1.x Trainer's name for fairscale's FSDP: registered so that asking for it explains what to use instead.
STRATEGY_REGISTRY.register(
    "ddp_fully_sharded",
    "fabric.strategies.fairscale._sharded:fairscale_fsdp_requested",
    "fairscale's FSDP: not offered, use fsdp",
)
STRATEGY_REGISTRY.register("single_xla", _path("SingleDeviceXLAStrategy"), "One process on one XLA device (TPU core)")
STRATEGY_REGISTRY.register(
    "xla", _path("XLAStrategy"), "One process per XLA device; gradients averaged in the optimizer step"
)
STRATEGY_REGISTRY.register(
    "xla_fsdp", _path("XLAFSDPStrategy"), "torch_xla's FSDP v1: parameters sharded over XLA devices"
)

__all__ = [
    "STRATEGY_REGISTRY",
    "DDPShardedStrategy",
    "DDPStrategy",
    "DataParallelStrategy",
    "DeepSpeedStrategy",
    "FSDPStrategy",
    "ModelParallelStrategy",
    "ParallelStrategy",
    "PipelineStrategy",
    "SingleDeviceStrategy",
    "SingleDeviceXLAStrategy",
    "Strategy",
    "XLAFSDPStrategy",
    "XLASPMDStrategy",
    "XLAStrategy",
]

"""Strategies (all distributed behaviour) and their registry."""

from fabric.registry import Registry
from fabric.strategies.ddp import DDPStrategy
from fabric.strategies.deepspeed import DeepSpeedStrategy
from fabric.strategies.dp import DataParallelStrategy
from fabric.strategies.fairscale import DDPShardedStrategy
from fabric.strategies.fairscale._sharded import fairscale_fsdp_requested
from fabric.strategies.fsdp import FSDPStrategy
from fabric.strategies.model_parallel import ModelParallelStrategy
from fabric.strategies.parallel import ParallelStrategy
from fabric.strategies.pipeline import PipelineStrategy
from fabric.strategies.single_device import SingleDeviceStrategy
from fabric.strategies.strategy import Strategy
from fabric.strategies.xla import SingleDeviceXLAStrategy, XLAFSDPStrategy, XLASPMDStrategy, XLAStrategy

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
STRATEGY_REGISTRY.register("dp", DataParallelStrategy, "DataParallel: one process, the model replicated over its GPUs")
STRATEGY_REGISTRY.register("fsdp", FSDPStrategy, "FSDP2 (fully_shard): parameters, gradients, optimizer state sharded")
STRATEGY_REGISTRY.register(
    "xla_spmd", XLASPMDStrategy, "One process drives every XLA device of the host as an SPMD mesh"
)
STRATEGY_REGISTRY.register("fsdp_cpu_offload", FSDPStrategy, "fsdp with shards kept in CPU memory", cpu_offload=True)

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
    STRATEGY_REGISTRY.register(_name, DeepSpeedStrategy, _what, **_kwargs)
# Lightning Fabric 1.9's names for fairscale (legacy, `torchfabric[fairscale]`); fairscale is imported on use.
STRATEGY_REGISTRY.register("ddp_sharded", DDPShardedStrategy, "fairscale OSS + ShardedDataParallel (legacy)")
STRATEGY_REGISTRY.register(
    "ddp_sharded_spawn", DDPShardedStrategy, "ddp_sharded with spawned processes", start_method="spawn"
)
# Lightning 1.x Trainer's name for fairscale's FSDP: registered so that asking for it explains what to use instead.
STRATEGY_REGISTRY.register("ddp_fully_sharded", fairscale_fsdp_requested, "fairscale's FSDP: not offered, use fsdp")
STRATEGY_REGISTRY.register("single_xla", SingleDeviceXLAStrategy, "One process on one XLA device (TPU core)")
STRATEGY_REGISTRY.register("xla", XLAStrategy, "One process per XLA device; gradients averaged in the optimizer step")
STRATEGY_REGISTRY.register("xla_fsdp", XLAFSDPStrategy, "torch_xla's FSDP v1: parameters sharded over XLA devices")

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

"""fairscale's sharded data parallel (`ddp_sharded`): OSS optimizer sharding with ShardedDataParallel (legacy)."""

from fabric.strategies.fairscale.strategy import DDPShardedStrategy

__all__ = ["DDPShardedStrategy"]

"""DeepSpeed ZeRO: the strategy, its config, its checkpoints and its gradient clipping."""

from fabric.strategies.deepspeed.strategy import DeepSpeedStrategy

__all__ = ["DeepSpeedStrategy"]

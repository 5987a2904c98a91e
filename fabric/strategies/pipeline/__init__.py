"""Pipeline parallelism: stages cut from the model by submodule name, run by torch.distributed.pipelining."""

from fabric.strategies.pipeline.strategy import PipelineStrategy

__all__ = ["PipelineStrategy"]

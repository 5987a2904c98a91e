"""The 2-D layout of pipeline parallelism with data parallelism: replicas x pipeline stages.

Processes are laid out pipeline-major (global rank = replica x pipeline size + pipeline rank), so the stages of one
pipeline, which talk at every microbatch, are neighbours; each stage is replicated with DDP over its replicas.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.nn import Module

if TYPE_CHECKING:
    from fabric.strategies.pipeline.strategy import PipelineStrategy

MESH_DIM_NAMES = ("data_parallel", "pipeline")


def build_mesh(strategy: PipelineStrategy) -> Any:
    """The (data_parallel, pipeline) device mesh; every process takes part in making its groups."""
    from torch.distributed.device_mesh import init_device_mesh

    sizes = (strategy.data_parallel_size, strategy.pipeline_size)
    return init_device_mesh(strategy.root_device.type, sizes, mesh_dim_names=MESH_DIM_NAMES)


def replicate(stage: Module, mesh: Any, device: Any) -> Module:
    """DDP over the stage's replicas; torch's pipeline stages sync it once per step, at the last microbatch."""
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(stage, device_ids=device_ids, process_group=mesh["data_parallel"].get_group())

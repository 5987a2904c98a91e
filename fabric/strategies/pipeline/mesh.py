"""The 2-D layout of pipeline parallelism with data parallelism: replicas x pipeline stages.

Processes are laid out pipeline-major (global rank = replica x pipeline size + pipeline rank), so the stages of one
pipeline, which talk at every microbatch, are neighbours; each stage is kept equal over its replicas with DDP or
FSDP2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.nn import Module

if TYPE_CHECKING:
    from fabric.strategies.pipeline.strategy import PipelineStrategy

MESH_DIM_NAMES = ("data_parallel", "pipeline")


def build_mesh(strategy: PipelineStrategy) -> Any:
    """The (data_parallel, pipeline) device mesh; every process takes part in making its groups."""
    from torch.distributed.device_mesh import init_device_mesh

    sizes = (strategy.data_parallel_size, strategy.pipeline_size)
    return init_device_mesh(strategy.root_device.type, sizes, mesh_dim_names=MESH_DIM_NAMES)


def replicate(stage: Module, mesh: Any, device: Any, how: str) -> Module:
    """Keep a stage equal over its replicas: DDP, or FSDP2 sharding over them. torch's pipeline stages know both:
    they synchronise once per step, after the last microbatch."""
    group = mesh["data_parallel"].get_group()
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [device.index] if device.type == "cuda" else None
        # find_unused_parameters=True: it turns off DDP's bucket rebuild after the first step, which miscounts the
        # parameters when several microbatches' backwards run before a synchronised one (GPipe: torch's reducer
        # asserts "rebuilt parameter indices size is not same as original model parameters size").
        from fabric.utilities.distributed import release_group_last

        wrapped = DistributedDataParallel(  # broadcasts replica 0's weights
            stage, device_ids=device_ids, process_group=group, find_unused_parameters=True
        )
        release_group_last(wrapped)
        return wrapped
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    with torch.no_grad():  # replicas start from replica 0's weights, as with DDP
        for tensor in [*stage.parameters(), *stage.buffers()]:
            dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
    fully_shard(stage, mesh=mesh["data_parallel"])
    return stage

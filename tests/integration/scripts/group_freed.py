"""Set up DDP through fabric in one process, destroy the group, and report whether the group object was freed.

A group that outlives destroy_process_group keeps gloo's worker threads until interpreter finalisation, where they
can abort the process; see fabric.strategies.parallel._import_before_group_exists.
"""

import gc
import json
import weakref

import torch
import torch.distributed as dist
from torch import nn

from fabric import Fabric


def main() -> None:
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=1)
    fabric.launch()
    model = fabric.setup(nn.Linear(4, 2))
    fabric.backward(model(torch.randn(3, 4)).sum())
    fabric.all_gather(torch.ones(2))
    group = weakref.ref(dist.group.WORLD)
    del model, fabric
    dist.destroy_process_group()
    gc.collect()
    print(json.dumps({"group_freed": group() is None}))


if __name__ == "__main__":
    main()

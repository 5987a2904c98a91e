"""Two FSDP2 ranks (gloo) save a sharded checkpoint to s3:// and load it back; one plain process loads it after.

Usage: python shck_s3.py OUTDIR S3_URL
The S3 endpoint and credentials come from the AWS_* environment variables (the test's loopback moto server).
Writes OUTDIR/rank{N}.pt and OUTDIR/after.pt: dicts of observations, or {"error": traceback}.
"""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _it_common import free_port, outdir_from_argv
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fabric import Fabric
from fabric.checkpoint import sharded as sc


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))


def shard(model: nn.Module) -> nn.Module:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    options = StateDictOptions(full_state_dict=True) if dist.is_initialized() else StateDictOptions()
    return {k: v.clone() for k, v in get_model_state_dict(model, options=options).items()}


def rank_main(rank: int, outdir: Path, url: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")  # fmt: skip
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    result: dict[str, Any] = {}
    try:
        model = shard(make_model(0))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        torch.manual_seed(rank)
        model(torch.randn(4, 6)).pow(2).mean().backward()
        optimizer.step()
        result["saved"] = full_weights(model)
        sc.save_sharded(url, {"model": model, "optimizer": optimizer, "step": 7}, None, 2, rank, dist.barrier)
        fresh = shard(make_model(1))
        fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.01)
        state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
        sc.load(url, state, strict=True)
        result["loaded"] = full_weights(fresh)
        result["step"] = state["step"]
    except Exception:
        result = {"error": traceback.format_exc()}
    dist.barrier()
    torch.save(result, outdir / f"rank{rank}.pt")
    dist.destroy_process_group()


def after(outdir: Path, url: str) -> None:
    try:
        model = make_model(9)
        remainder = Fabric(accelerator="cpu").load(url, {"model": model})
        result: dict[str, Any] = {"loaded": full_weights(model), "remainder": remainder}
    except Exception:
        result = {"error": traceback.format_exc()}
    torch.save(result, outdir / "after.pt")


def main() -> None:
    outdir = outdir_from_argv()
    url = sys.argv[2]
    torch.set_num_threads(1)
    mp.start_processes(rank_main, args=(outdir, url, free_port()), nprocs=2, start_method="fork")
    after(outdir, url)


if __name__ == "__main__":
    main()

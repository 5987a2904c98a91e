"""Sharded checkpoints across world sizes: 1 process saves, 2 FSDP2 ranks (gloo) save and load, 1 process loads.

Usage: python shck_ranks.py OUTDIR
The parent imports torch once and forks the two ranks (a second torch import per rank would double the run time).
It writes OUTDIR/single.pt (before the ranks), OUTDIR/rank{N}.pt (each rank) and OUTDIR/after.pt (after the
ranks, with no process group): dicts from check name to observations, or {"error": traceback}.
"""

from __future__ import annotations

import hashlib
import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _it_common import free_port, outdir_from_argv
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from fabric import Fabric
from fabric.checkpoint import sharded as sc
from fabric.checkpoint.files import staging_dir
from fabric.wrappers import unwrap_objects

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))


def shard(model: nn.Module) -> nn.Module:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(4, 6)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Whole tensors on every rank (works for sharded and plain models, with or without a process group)."""
    options = StateDictOptions() if not dist.is_initialized() else StateDictOptions(full_state_dict=True)
    result: dict[str, Any] = {"model": get_model_state_dict(model, options=options)}
    if optimizer is not None:
        result["optimizer"] = get_optimizer_state_dict(model, optimizer, options=options)["state"]
    return result


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def error_of(fn: Callable[[], Any]) -> str | None:
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


# -- checks run by each of the two ranks ---------------------------------------------------------------
def save_and_reload(outdir: Path) -> Any:
    model = shard(make_model(0))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    train_step(model, optimizer, seed=dist.get_rank())  # different data per rank; FSDP averages the gradients
    saved = full_state(model, optimizer)
    sc.save_sharded(outdir / "sharded", {"model": model, "optimizer": optimizer, "step": 7}, None, 2, dist.get_rank(),
                    dist.barrier)  # fmt: skip
    fresh = shard(make_model(1))
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.5)  # no state yet, and another learning rate
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    remainder = sc.load(outdir / "sharded", state, strict=True)
    return {
        "saved": saved,
        "loaded": full_state(fresh, fresh_optimizer),
        "lr": fresh_optimizer.param_groups[0]["lr"],
        "step": state["step"],
        "remainder": remainder,
        "listing": sorted(p.name for p in (outdir / "sharded").iterdir()),
        "staging_left": staging_dir(outdir / "sharded").exists(),
    }


def load_saved_by_one(outdir: Path) -> Any:
    model = shard(make_model(5))
    optimizer = torch.optim.Adam(model.parameters())
    sc.load(outdir / "single", {"model": model, "optimizer": optimizer}, strict=True)
    return full_state(model, optimizer)


def load_plain_file(outdir: Path) -> Any:
    model = shard(make_model(5))
    optimizer = torch.optim.Adam(model.parameters())
    sc.load(outdir / "single_plain.pt", {"model": model, "optimizer": optimizer}, strict=True)
    return full_state(model, optimizer)


def load_into_ddp(outdir: Path) -> Any:
    model = DistributedDataParallel(make_model(6))
    remainder = sc.load(outdir / "sharded", {"model": model}, strict=True)
    return {"model": {k: v.clone() for k, v in model.module.state_dict().items()}, "remainder": sorted(remainder)}


def full_file(outdir: Path) -> Any:
    model = shard(make_model(0))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    train_step(model, optimizer, seed=3)
    from fabric.io import TorchCheckpointIO

    sc.save_full(outdir / "full.pt", {"model": model, "optimizer": optimizer, "step": 9}, None, TorchCheckpointIO(),
                 dist.get_rank() == 0)  # fmt: skip
    dist.barrier()
    fresh = shard(make_model(1))
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.01)
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    sc.load(outdir / "full.pt", state, strict=True)
    return {"saved": full_state(model, optimizer), "loaded": full_state(fresh, fresh_optimizer), "step": state["step"]}


def failed_save(outdir: Path) -> Any:
    folder = outdir / "sharded"
    before = digest(folder)
    model = shard(make_model(2))
    # A lambda cannot be pickled: the write fails after the shards of the model were already written.
    error = error_of(lambda: sc.save_sharded(folder, {"model": model, "fn": lambda x: x}, None, 2, dist.get_rank(),
                                             dist.barrier))  # fmt: skip
    dist.barrier()
    return {"error": error, "unchanged": digest(folder) == before, "staging_left": staging_dir(folder).exists()}


def wrong_shape(outdir: Path) -> Any:
    torch.manual_seed(0)
    model = shard(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5)))
    return error_of(lambda: sc.load(outdir / "sharded", {"model": model}, strict=True))


def tensor_parallel(outdir: Path) -> Any:
    """DTensor (tensor-parallel) modules: column then row sharding of the two layers."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = parallelize_module(make_model(4), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    sc.save_sharded(outdir / "tp", {"model": model}, None, 2, dist.get_rank(), dist.barrier)
    return full_state(model)


def through_fabric(outdir: Path) -> Any:
    """End to end with the FSDP strategy on the process group this script created."""
    fabric = Fabric(accelerator="cpu", strategy="fsdp", devices=2)
    fabric.launch()
    model = fabric.setup_module(make_model(0))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.01))
    fabric.backward(model(torch.randn(4, 6)).pow(2).mean())
    optimizer.step()
    fabric.save(outdir / "fabric", {"model": model, "optimizer": optimizer, "step": 11})
    saved = full_state(unwrap_objects(model))
    fresh = fabric.setup_module(make_model(1))
    fresh_optimizer = fabric.setup_optimizers(torch.optim.Adam(fresh.parameters(), lr=0.01))
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    fabric.load(outdir / "fabric", state)
    return {"saved": saved, "loaded": full_state(unwrap_objects(fresh)), "step": state["step"]}


RANK_CHECKS: list[Callable[[Path], Any]] = [
    save_and_reload, load_saved_by_one, load_plain_file, load_into_ddp,
    full_file, failed_save, wrong_shape, tensor_parallel, through_fabric,
]  # fmt: skip


def rank_main(rank: int, outdir: Path, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")  # fmt: skip
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    results: dict[str, Any] = {}
    for check in RANK_CHECKS:
        try:
            results[check.__name__] = check(outdir)
        except Exception:
            results[check.__name__] = {"error": traceback.format_exc()}
        dist.barrier()
    torch.save(results, outdir / f"rank{rank}.pt")
    dist.destroy_process_group()


# -- the single process, before and after the ranks ---------------------------------------------------
def save_single(outdir: Path) -> Any:
    model = make_model(3)
    optimizer = torch.optim.Adam(model.parameters())
    train_step(model, optimizer, seed=4)
    sc.save_sharded(outdir / "single", {"model": model, "optimizer": optimizer}, None, 1, 0, lambda: None)
    # What a single-device or DDP fabric.save writes: optimizer state keyed by parameter position.
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, outdir / "single_plain.pt")
    return full_state(model, optimizer)


def load_without_group(outdir: Path) -> Any:
    model = make_model(9)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    remainder = sc.load(outdir / "sharded", state, strict=True)
    return {"loaded": full_state(model, optimizer), "step": state["step"], "remainder": remainder}


def load_tensor_parallel(outdir: Path) -> Any:
    model = make_model(9)
    sc.load(outdir / "tp", {"model": model}, strict=True)
    return full_state(model)


def consolidated(outdir: Path) -> Any:
    whole = sc.consolidate(outdir / "sharded")
    plain = make_model(9)
    plain.load_state_dict(whole["model"])
    return {"whole": whole, "plain": plain.state_dict()}


def fabric_cpu_load(outdir: Path) -> Any:
    fabric = Fabric(accelerator="cpu")
    model = fabric.setup_module(make_model(8))
    state = {"model": model, "step": 0}
    remainder = fabric.load(outdir / "sharded", state)
    return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "step": state["step"],
            "remainder": sorted(remainder)}  # fmt: skip


def run_single(outdir: Path, name: str, checks: list[Callable[[Path], Any]]) -> None:
    results: dict[str, Any] = {}
    for check in checks:
        try:
            results[check.__name__] = check(outdir)
        except Exception:
            results[check.__name__] = {"error": traceback.format_exc()}
    torch.save(results, outdir / name)


def main() -> None:
    outdir = outdir_from_argv()
    torch.set_num_threads(1)
    run_single(outdir, "single.pt", [save_single])
    mp.start_processes(rank_main, args=(outdir, free_port()), nprocs=2, start_method="fork")
    run_single(outdir, "after.pt", [load_without_group, load_tensor_parallel, consolidated, fabric_cpu_load])


if __name__ == "__main__":
    main()

"""Sharded (FSDP2, 2 gloo ranks) saves with AsyncCheckpointIO: snapshot, training during the write, order, errors.

Usage: python async_sharded.py OUTDIR
The parent imports torch once and forks the two ranks. Each rank writes OUTDIR/rank{N}.pt: a dict from check name
to observations, or {"error": traceback}.
"""

from __future__ import annotations

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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fabric import AsyncCheckpointIO, Fabric
from fabric.checkpoint.files import staging_dir
from fabric.wrappers import unwrap_objects


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))


def full_weights(model: Any) -> dict[str, torch.Tensor]:
    return get_model_state_dict(unwrap_objects(model), options=StateDictOptions(full_state_dict=True))


def train_step(fabric: Fabric, model: Any, optimizer: Any, seed: int) -> None:
    torch.manual_seed(seed + fabric.global_rank)
    fabric.backward(model(torch.randn(4, 6)).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()


def setup(fabric: Fabric, seed: int) -> tuple[Any, Any]:
    model = fabric.setup_module(make_model(seed))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.01))
    return model, optimizer


def snapshot_and_training_during_write(fabric: Fabric, outdir: Path) -> Any:
    model, optimizer = setup(fabric, 0)
    train_step(fabric, model, optimizer, seed=1)
    saved = full_weights(model)
    fabric.save(outdir / "ckpt", {"model": model, "optimizer": optimizer, "step": 3})
    # Train on (FSDP collectives in this thread) while DCP writes in the background with its own group.
    for seed in range(2, 5):
        train_step(fabric, model, optimizer, seed)
    trained = full_weights(model)
    fresh, fresh_optimizer = setup(fabric, 9)
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    fabric.load(outdir / "ckpt", state)  # waits for the write and rank 0's swap
    loaded = full_weights(fresh)
    return {
        "equal_saved": all(torch.equal(loaded[k], saved[k]) for k in saved),
        "differs_from_trained": any(not torch.equal(loaded[k], trained[k]) for k in saved),
        "step": state["step"],
        "listing": sorted(p.name for p in (outdir / "ckpt").iterdir()),
        "staging_left": staging_dir(outdir / "ckpt").exists(),
    }


def second_save_wins(fabric: Fabric, outdir: Path) -> Any:
    model, optimizer = setup(fabric, 0)
    fabric.save(outdir / "twice", {"model": model, "version": 1})
    train_step(fabric, model, optimizer, seed=7)
    second = full_weights(model)
    fabric.save(outdir / "twice", {"model": model, "version": 2})
    fabric.barrier()  # after a barrier the checkpoint is complete on disk
    on_disk = sorted(p.name for p in (outdir / "twice").iterdir())
    fresh, _ = setup(fabric, 9)
    state = {"model": fresh, "version": 0}
    fabric.load(outdir / "twice", state)
    loaded = full_weights(fresh)
    return {"version": state["version"], "equal_second": all(torch.equal(loaded[k], second[k]) for k in second),
            "on_disk": on_disk}  # fmt: skip


def background_failure(fabric: Fabric, outdir: Path) -> Any:
    model, _ = setup(fabric, 0)
    before = sorted(p.name for p in (outdir / "ckpt").iterdir())
    # A lambda cannot be pickled: DCP fails while writing, in the background, on every rank.
    fabric.save(outdir / "ckpt", {"model": model, "fn": lambda x: x})
    message = None
    try:
        fabric.barrier()
    except RuntimeError as err:
        message = str(err)
    fabric.barrier()  # the error was raised once; the next barrier passes
    return {"message": message, "unchanged": sorted(p.name for p in (outdir / "ckpt").iterdir()) == before,
            "staging_left": staging_dir(outdir / "ckpt").exists()}  # fmt: skip


def other_strategies(fabric: Fabric, outdir: Path) -> Any:
    """DDP (rank 0 writes one file) and FSDP full checkpoints: every rank loads the new file right after saving."""
    from fabric.strategies import FSDPStrategy

    results = {}
    for name, strategy in (("ddp", "ddp"), ("full", FSDPStrategy(state_dict_type="full"))):
        other = Fabric(accelerator="cpu", strategy=strategy, devices=2, plugins=[AsyncCheckpointIO()])
        other.launch()
        model = other.setup_module(make_model(3))
        saved = full_weights(model) if name == "full" else {k: v.clone() for k, v in model.state_dict().items()}
        other.save(outdir / f"{name}.pt", {"model": model, "step": 4})
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1.0)
        fresh = other.setup_module(make_model(8))
        state = {"model": fresh, "step": 0}
        other.load(outdir / f"{name}.pt", state)  # no barrier before it: load itself waits for rank 0's write
        loaded = full_weights(fresh) if name == "full" else fresh.state_dict()
        results[name] = {"step": state["step"], "equal": all(torch.equal(loaded[k], saved[k]) for k in saved)}
        if name == "ddp":  # load_raw also waits on every rank
            other.save(outdir / "ddp_raw.pt", dict(saved))
            raw = make_model(9)
            other.load_raw(outdir / "ddp_raw.pt", raw)
            results["ddp_raw"] = all(torch.equal(raw.state_dict()[k], saved[k]) for k in saved)
    return results


def ddp_reserves_on_rank_0_only(fabric: Fabric, outdir: Path) -> Any:
    """DDP with an optimizer: after the first step rank 0 (the one that writes) reserves the first save's buffers."""
    io = AsyncCheckpointIO()
    ddp = Fabric(accelerator="cpu", strategy="ddp", devices=2, plugins=[io])
    ddp.launch()
    torch.manual_seed(0)
    module = nn.Linear(512, 1024)  # a 2 MiB weight: reserved with its two Adam moments
    model, optimizer = ddp.setup(module, torch.optim.Adam(module.parameters()))
    hooks = len(optimizer.optimizer._optimizer_step_post_hooks)
    ddp.backward(model(torch.randn(2, 512)).sum())
    optimizer.step()
    io._pool._collect_reservation()
    reserved = io._pool.nbytes
    ddp.save(outdir / "ddp_reserved.pt", {"model": model, "optimizer": optimizer})
    ddp.barrier()
    loaded = torch.load(outdir / "ddp_reserved.pt", weights_only=True)
    equal = torch.equal(loaded["model"]["weight"], module.weight.detach())
    return {"hooks": hooks, "reserved": reserved, "equal": equal}


CHECKS: list[Callable[[Fabric, Path], Any]] = [
    snapshot_and_training_during_write, second_save_wins, background_failure, other_strategies,
    ddp_reserves_on_rank_0_only,
]  # fmt: skip


def rank_main(rank: int, outdir: Path, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")  # fmt: skip
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    fabric = Fabric(accelerator="cpu", strategy="fsdp", devices=2, plugins=[AsyncCheckpointIO()])
    fabric.launch()
    results: dict[str, Any] = {}
    for check in CHECKS:
        try:
            results[check.__name__] = check(fabric, outdir)
        except Exception:
            results[check.__name__] = {"error": traceback.format_exc()}
        dist.barrier()
    fabric.save(outdir / "last", {"model": setup(fabric, 5)[0]})
    fabric.strategy.teardown()  # waits for the last save before the process group goes
    results["last_complete"] = sorted(p.name for p in (outdir / "last").iterdir())
    torch.save(results, outdir / f"rank{rank}.pt")
    dist.destroy_process_group()


def main() -> None:
    outdir = outdir_from_argv()
    torch.set_num_threads(1)
    mp.start_processes(rank_main, args=(outdir, free_port()), nprocs=2, start_method="fork")


if __name__ == "__main__":
    main()

"""DeepSpeed ZeRO 1-3 on two CPU ranks over gloo: parity with DDP, clipping, checkpoints, errors, collectives.

Usage: python ds_ranks.py OUTDIR
The parent forks the two ranks, which join one gloo group and run every check with fresh Fabric objects (so
DeepSpeed's CPU communication op is compiled, or loaded from its cache, once). After they exit, the parent loads
their checkpoints in a single process (another world size). Results: OUTDIR/rank{N}.pt and OUTDIR/single.pt,
dicts from check name to observations, or {"error": traceback}.
"""

from __future__ import annotations

import os
import shutil
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _it_common import free_port, outdir_from_argv, run_each
from torch import nn

from fabric import Fabric
from fabric.strategies.deepspeed import DeepSpeedStrategy
from fabric.utilities.warnings import PossibleUserWarning

STEPS = 3
LR = 0.05


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def model_and_optimizer(fabric: Fabric, seed: int = 0, sgd: bool = False) -> tuple[Any, Any]:
    model = make_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if sgd else torch.optim.AdamW(model.parameters(), lr=LR)
    return fabric.setup(model, optimizer)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's own batch, the same in the DDP and the DeepSpeed run."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)


def loss_of(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, rank)
    return nn.functional.cross_entropy(model(x), y)


def fabric_for(stage: int, **kwargs: Any) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=DeepSpeedStrategy(stage=stage, **kwargs))
    fabric.launch()
    return fabric


def ddp_run(rank: int, clip: float | None) -> dict[str, Any]:
    """The unsharded reference: torch's own DDP on the same group, data and seed."""
    model = nn.parallel.DistributedDataParallel(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        loss = loss_of(model, step, rank)
        optimizer.zero_grad()
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "weights": {k: v.clone() for k, v in model.module.state_dict().items()}}


def ds_run(stage: int, rank: int, clip: float | None, outdir: Path) -> dict[str, Any]:
    fabric = fabric_for(stage)
    model, optimizer = model_and_optimizer(fabric)
    losses, norms = [], []
    for step in range(STEPS):
        loss = loss_of(model, step, rank)
        optimizer.zero_grad()
        fabric.backward(loss)
        if clip is not None:
            norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=clip)))
        optimizer.step()
        losses.append(loss.item())
    path = outdir / f"parity_stage{stage}_{clip}"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": STEPS})
    from fabric.strategies.deepspeed.checkpoint import consolidate_deepspeed

    weights = consolidate_deepspeed(path)["model"]
    return {"losses": losses, "norms": norms, "weights": weights, "is_dir": path.is_dir()}


def parity(rank: int, outdir: Path) -> dict[str, Any]:
    """Losses and final weights of ZeRO 1, 2, 3 next to DDP's, with and without clipping."""
    result: dict[str, Any] = {"ddp": ddp_run(rank, None), "ddp_clip": ddp_run(rank, 0.05)}
    for stage in (1, 2, 3):
        result[f"stage{stage}"] = ds_run(stage, rank, None, outdir)
        result[f"stage{stage}_clip"] = ds_run(stage, rank, 0.05, outdir)
    return result


def roundtrip(rank: int, outdir: Path) -> dict[str, Any]:
    """Save after 2 steps, train a 3rd; a fresh run that loads the checkpoint must give the same 3rd loss."""
    result: dict[str, Any] = {}
    for stage in (2, 3):
        fabric = fabric_for(stage)
        model, optimizer = model_and_optimizer(fabric)
        for step in range(2):
            fabric.backward(loss_of(model, step, rank))
            optimizer.step()
        path = outdir / f"roundtrip_stage{stage}"
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2, "note": {"text": "kept"}})
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2, "note": {"text": "kept"}})  # replace
        expected = loss_of(model, 2, rank).item()
        fabric2 = fabric_for(stage)
        model2, optimizer2 = model_and_optimizer(fabric2, seed=7)
        state: dict[str, Any] = {"model": model2, "optimizer": optimizer2, "step": 0, "note": None}
        remainder = fabric2.load(path, state)
        observed = loss_of(model2, 2, rank).item()
        fabric2.backward(loss_of(model2, 2, rank))
        optimizer2.step()  # the restored optimizer state must be usable
        result[f"stage{stage}"] = {
            "expected": expected,
            "observed": observed,
            "step": state["step"],
            "note": state["note"],
            "remainder": remainder,
            "listing": sorted(p.name for p in path.iterdir()),
            "siblings": sorted(p.name for p in outdir.iterdir() if p.name.startswith(f".roundtrip_stage{stage}")),
        }
    return result


def error_of(fn: Callable[[], Any]) -> str | None:
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def errors(rank: int, outdir: Path) -> dict[str, Any]:
    """Each misuse gives its message, on every rank, without a hang."""
    fabric = fabric_for(2)
    opt_a = torch.optim.SGD(make_model().parameters(), lr=0.1)
    own = make_model()
    # Partly outside the model: fabric's general check only warns (several processes); DeepSpeed refuses it.
    partly = torch.optim.SGD([*own.parameters(), nn.Parameter(torch.zeros(2))], lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PossibleUserWarning)
        partly_foreign = error_of(lambda: fabric.setup(own, partly))
    both = [torch.optim.SGD(own.parameters(), lr=0.1) for _ in range(2)]
    result = {
        "foreign_optimizer": error_of(lambda: fabric.setup(make_model(), opt_a)),
        "partly_foreign_optimizer": partly_foreign,
        "two_optimizers": error_of(lambda: fabric.setup(own, *both)),
        "setup_optimizers": error_of(lambda: fabric.setup_optimizers(opt_a)),
    }
    inference = fabric_for(2)
    model_only = inference.setup(make_model())
    result["backward_without_optimizer"] = error_of(lambda: inference.backward(loss_of(model_only, 0, rank)))
    fabric = fabric_for(2)
    model, optimizer = model_and_optimizer(fabric, sgd=True)
    result["no_backward_sync"] = error_of(lambda: fabric.no_backward_sync(model).__enter__())
    fabric.backward(loss_of(model, 0, rank))
    result["clip_val"] = error_of(lambda: fabric.clip_gradients(model, optimizer, clip_val=0.1))
    result["clip_norm_type"] = error_of(lambda: fabric.clip_gradients(model, optimizer, max_norm=1.0, norm_type=1))
    optimizer.step()
    result["filter"] = error_of(lambda: fabric.save(outdir / "f", {"model": model}, filter={"model": lambda k, v: 1}))
    good = outdir / "errors_ckpt"
    fabric.save(good, {"model": model, "optimizer": optimizer})
    broken = outdir / "errors_broken"
    if rank == 0:
        shutil.copytree(good, broken)
        (broken / "checkpoint" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    fabric.barrier()
    result["missing_rank_file"] = error_of(lambda: fabric.load(broken, {"model": model, "optimizer": optimizer}))
    result["not_a_checkpoint"] = error_of(lambda: fabric.load(outdir, {"model": model}))
    result["missing_key"] = error_of(lambda: fabric.load(good, {"model": model, "optimizer": optimizer, "x": 1}))
    return result


def inference_and_collectives(rank: int, outdir: Path) -> dict[str, Any]:
    """Model-only setup (stage 3 shards it) computes what the plain model does; collectives work."""
    fabric = fabric_for(3)
    with fabric.init_module():
        created = make_model()
    partitioned = all(hasattr(p, "ds_id") and p.numel() == 0 for p in created.parameters())
    model = fabric.setup(make_model())
    x, _ = batch(0, rank)
    with torch.no_grad():
        same = torch.allclose(model(x), make_model()(x), atol=1e-6)
    value = torch.tensor([float(rank + 1)])
    return {
        "init_module_partitioned": partitioned,
        "forward_matches": same,
        "all_reduce": fabric.all_reduce(value, reduce_op="sum").tolist(),
        "all_gather": fabric.all_gather(value).flatten().tolist(),
        "broadcast": fabric.broadcast({"from": rank}, src=1),
        "barrier": fabric.barrier() is None,
    }


CHECKS = {"parity": parity, "roundtrip": roundtrip, "errors": errors, "inference": inference_and_collectives}


def rank_main(rank: int, port: int, outdir: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", NODE_RANK="0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results: dict[str, Any] = {}
    try:
        run_each(CHECKS, lambda check: check(rank, outdir), dist.barrier, results)
    finally:
        torch.save(results, outdir / f"rank{rank}.pt")
        dist.destroy_process_group()


def single_process(outdir: Path) -> dict[str, Any]:
    """Load the 2-rank checkpoints on 1 rank: model weights restored, optimizer state fresh, with a warning."""
    result: dict[str, Any] = {}
    for stage in (2, 3):
        fabric = Fabric(accelerator="cpu", devices=1, strategy=DeepSpeedStrategy(stage=stage))
        fabric.launch()
        model, optimizer = model_and_optimizer(fabric, seed=5)
        state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fabric.load(outdir / f"parity_stage{stage}_None", state)
        from fabric.strategies.deepspeed.checkpoint import full_weights

        with torch.no_grad():
            x, _ = batch(0, 0)
            output = model(x)
        # One more step: it must start from the loaded weights, i.e. DeepSpeed's float32 master copy was refreshed.
        fabric.backward(loss_of(model, 0, 0))
        optimizer.step()
        after = outdir / f"single_stage{stage}"
        fabric.save(after, {"model": model, "optimizer": optimizer})
        result[f"stage{stage}"] = {
            "after_step": full_weights(after),
            "output": output,
            "weights": full_weights(outdir / f"parity_stage{stage}_None"),
            "step": state["step"],
            "warnings": [str(w.message) for w in caught],
        }
        fabric.strategy.teardown()
    return result


def main() -> None:
    outdir = outdir_from_argv()
    port = free_port()
    context = mp.get_context("fork")
    procs = [context.Process(target=rank_main, args=(rank, port, outdir)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    if any(proc.exitcode != 0 for proc in procs):
        raise SystemExit(f"rank exit codes: {[proc.exitcode for proc in procs]}")
    try:
        single = single_process(outdir)
    except Exception:
        single = {"error": traceback.format_exc()}
    torch.save(single, outdir / "single.pt")


if __name__ == "__main__":
    main()

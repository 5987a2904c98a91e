"""ModelParallelStrategy on 2 CPU ranks: tensor parallel (tp=2) and data parallel (dp=2), against unsharded runs.

Usage: python mp_train.py OUTDIR
Each rank writes OUTDIR/rank{N}.pt: check name -> what this rank observed (or {"error": traceback}).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _it_common import outdir_from_argv, run_each
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric
from fabric.strategies import ModelParallelStrategy

SEED = 4321


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def make_loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 16, generator=generator)
    return DataLoader(TensorDataset(x, torch.randn(32, 4, generator=generator)), batch_size=8)


def tensor_parallel(model: nn.Module, mesh: Any) -> nn.Module:
    parallelize_module(model, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def data_parallel(model: nn.Module, mesh: Any) -> nn.Module:
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def no_sharding(model: nn.Module, mesh: Any) -> nn.Module:
    return model


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    module = getattr(model, "module", model)
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in module.named_parameters()
    }


def run(fabric: Fabric | None, model: Any, optimizer: Any, batches: list[Any], ddp_style: bool) -> dict[str, Any]:
    """Train on `batches`; returns losses (averaged over the data-parallel replicas), clip norms, weights."""
    losses, norms = [], []
    for x, y in batches:
        loss = nn.functional.mse_loss(model(x), y)
        if fabric is not None:
            fabric.backward(loss)
            norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=0.5)))
        else:
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)))
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()
        if ddp_style:
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(value.item())
    return {"losses": losses, "norms": norms, "weights": full_weights(model)}


def with_strategy(parallelize_fn: Callable, dp: int | str, tp: int | str) -> Fabric:
    strategy = ModelParallelStrategy(parallelize_fn, data_parallel_size=dp, tensor_parallel_size=tp)
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2)
    fabric.launch()
    return fabric


def fabric_run(fabric: Fabric, empty_init: bool = False) -> tuple[dict[str, Any], list[Any]]:
    fabric.seed_everything(SEED, verbose=False)
    with fabric.init_module(empty_init=empty_init):
        model = make_model()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    batches = list(fabric.setup_dataloaders(make_loader()))
    # A DP-averaged loss: equal to the global loss when dp=2, and the same value on both ranks when tp=2.
    result = run(fabric, model, optimizer, batches, ddp_style=True)
    result["placements"] = {n: str(p.placements) for n, p in model.module.named_parameters()}
    result["local"] = {n: p.to_local().detach().clone() for n, p in model.module.named_parameters()}
    return result, batches


def tp2(base: Fabric) -> Any:
    fabric = with_strategy(tensor_parallel, dp=1, tp=2)
    result, batches = fabric_run(fabric)
    torch.manual_seed(SEED)
    reference = make_model()  # tp=2, dp=1: one replica, so the reference is plain local training on its batches
    expected = run(None, reference, torch.optim.SGD(reference.parameters(), lr=0.1), batches, ddp_style=False)
    return {"fabric": result, "reference": expected, "batches": [x for x, _ in batches]}


def dp2(base: Fabric) -> Any:
    fabric = with_strategy(data_parallel, dp=2, tp=1)
    result, batches = fabric_run(fabric)
    torch.manual_seed(SEED)
    reference = DistributedDataParallel(make_model())
    expected = run(None, reference, torch.optim.SGD(reference.parameters(), lr=0.1), batches, ddp_style=True)
    return {"fabric": result, "reference": expected, "batches": [x for x, _ in batches]}


def tp2_empty_init(base: Fabric) -> Any:
    fabric = with_strategy(tensor_parallel, dp=1, tp=2)
    result, _ = fabric_run(fabric, empty_init=True)
    return result


def dp2_without_fully_shard(base: Fabric) -> Any:
    fabric = with_strategy(no_sharding, dp=2, tp=1)
    try:
        fabric.setup_module(make_model())
    except RuntimeError as err:
        return {"raised": str(err)}
    return {"raised": None}


CHECKS: dict[str, Callable[[Fabric], Any]] = {
    "tp2": tp2,
    "dp2": dp2,
    "tp2_empty_init": tp2_empty_init,
    "dp2_without_fully_shard": dp2_without_fully_shard,
}


def main() -> None:
    outdir = outdir_from_argv()
    fabric = with_strategy(data_parallel, dp="auto", tp="auto")
    strategy = fabric.strategy
    assert isinstance(strategy, ModelParallelStrategy)
    results: dict[str, Any] = {"auto_sizes": (strategy.data_parallel_size, strategy.tensor_parallel_size)}
    run_each(CHECKS, lambda check: check(fabric), fabric.barrier, results)
    torch.save(results, outdir / f"rank{fabric.global_rank}.pt")


if __name__ == "__main__":
    main()

"""FSDP with CPU offload and gradient clipping on 2 ranks, checked against raw DDP in the same process group;
then a float16 run whose loss-scaler state goes through a sharded checkpoint.

Usage: python fsdp_offload_clip.py OUTDIR [cpu|cuda]
On the CPU the group is "cpu:gloo,cuda:gloo": the mixed backend string FSDP picks on GPUs ("cpu:gloo,cuda:nccl"),
with gloo standing in for NCCL. On GPUs the strategy chooses the backend itself. Each rank writes
OUTDIR/rank{N}.pt with the backend, the clipped norms and the weights of both runs, and the scales before saving
and after loading (or {"error": traceback}).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _it_common import outdir_from_argv
from fsdp_train import SEED, batch, ddp_reference, fabric_step, make_model, train

from fabric import Fabric
from fabric.precision import MixedPrecision
from fabric.strategies import FSDPStrategy


def offloaded_run(fabric: Fabric) -> dict[str, Any]:
    fabric.seed_everything(SEED, verbose=False)
    with fabric.init_module():
        model = make_model()
    built_on = sorted({p.device.type for p in model.parameters()})  # not the GPU: offloading would be undone
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    def clip(model: Any, optimizer: Any) -> torch.Tensor:
        grad_devices.update(str(p.grad.to_local().device.type) for p in model.parameters() if p.grad is not None)
        return fabric.clip_gradients(model, optimizer, max_norm=0.5)

    def step(model: Any, x: torch.Tensor, y: torch.Tensor, sync: bool) -> float:
        return fabric_step(fabric)(model, x.to(fabric.device), y.to(fabric.device), sync)

    grad_devices: set[str] = set()
    result = train(model, optimizer, fabric.global_rank, step, clip=clip)
    result["weights"] = {k: v.cpu() for k, v in result["weights"].items()}
    result["grad_devices"] = sorted(grad_devices)
    result["built_on"] = built_on
    result["shard_devices"] = sorted({p.to_local().device.type for p in model.parameters()})
    return result


def scaler_through_sharded_checkpoint(accelerator: str, outdir: Path) -> dict[str, Any]:
    """16-mixed under FSDP (a ShardedGradScaler), saved as a sharded directory and loaded into a fresh run."""

    def make() -> tuple[Fabric, Any, Any]:
        device = "cpu" if accelerator == "cpu" else "cuda"
        scaler = torch.amp.GradScaler(device, init_scale=2.0**24, growth_interval=2)
        plugin = MixedPrecision("16-mixed", device=device, scaler=scaler)
        fabric = Fabric(accelerator=accelerator, strategy="fsdp", devices=2, plugins=[plugin])
        fabric.launch()  # joins the existing group
        fabric.seed_everything(SEED, verbose=False)
        model = fabric.setup_module(make_model())
        return fabric, model, fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=1e-3))

    fabric, model, optimizer = make()
    for step in range(5):
        x, _ = batch(step, fabric.global_rank)
        fabric.backward(model(x.to(fabric.device) * 30).float().pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    saved = fabric.strategy.precision.state_dict()
    fabric.save(outdir / "scaler_ckpt", {"model": model, "optimizer": optimizer})
    other, model_b, optimizer_b = make()
    remainder = other.load(outdir / "scaler_ckpt", {"model": model_b, "optimizer": optimizer_b})
    return {"saved": saved, "loaded": other.strategy.precision.state_dict(), "remainder": sorted(remainder)}


def main() -> None:
    outdir = outdir_from_argv()
    accelerator = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    backend = "cpu:gloo,cuda:gloo" if accelerator == "cpu" else None
    strategy = FSDPStrategy(cpu_offload=True, process_group_backend=backend)
    fabric = Fabric(accelerator=accelerator, strategy=strategy, devices=2)
    fabric.launch()
    results: dict[str, Any] = {"backend": str(dist.get_backend())}
    try:
        results["fsdp"] = offloaded_run(fabric)
        if accelerator == "cpu":  # the reference needs a CPU model; on GPUs the test compares the two ranks
            results["ddp"] = ddp_reference(fabric, clip=True)
        results["scaler"] = scaler_through_sharded_checkpoint(accelerator, outdir)
    except Exception:
        results["error"] = traceback.format_exc()
    torch.save(results, outdir / f"rank{fabric.global_rank}.pt")
    fabric.barrier()


if __name__ == "__main__":
    main()

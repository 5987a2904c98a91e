"""FSDP with CPU offload and gradient clipping on 2 ranks, checked against raw DDP in the same process group.

Usage: python fsdp_offload_clip.py OUTDIR [cpu|cuda]
On the CPU the group is "cpu:gloo,cuda:gloo": the mixed backend string FSDP picks on GPUs ("cpu:gloo,cuda:nccl"),
with gloo standing in for NCCL. On GPUs the strategy chooses the backend itself. Each rank writes
OUTDIR/rank{N}.pt with the backend, the clipped norms and the weights of both runs (or {"error": traceback}).
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
from _it_common import outdir_from_argv
from fsdp_train import SEED, ddp_reference, fabric_step, make_model, train

from fabric import Fabric
from fabric.strategies import FSDPStrategy


def offloaded_run(fabric: Fabric) -> dict[str, Any]:
    fabric.seed_everything(SEED, verbose=False)
    with fabric.init_module():
        model = make_model()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    def clip(model: Any, optimizer: Any) -> torch.Tensor:
        grad_devices.update(str(p.grad.to_local().device.type) for p in model.parameters() if p.grad is not None)
        return fabric.clip_gradients(model, optimizer, max_norm=0.5)

    grad_devices: set[str] = set()
    result = train(model, optimizer, fabric.global_rank, fabric_step(fabric), clip=clip)
    result["weights"] = {k: v.cpu() for k, v in result["weights"].items()}
    result["grad_devices"] = sorted(grad_devices)
    result["shard_devices"] = sorted({p.to_local().device.type for p in model.parameters()})
    return result


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
    except Exception:
        results["error"] = traceback.format_exc()
    torch.save(results, outdir / f"rank{fabric.global_rank}.pt")
    fabric.barrier()


if __name__ == "__main__":
    main()

"""DDP over NCCL on 2 GPUs: parity with raw DDP, every collective, and a checkpoint holding CUDA tensors.

Usage: python gpu_ddp.py OUTDIR
Each rank writes OUTDIR/rank{N}.pt. Raw DDP and fabric train the same model from the same seed on the same
batches in the same process group, so their weights must be equal.
"""

from __future__ import annotations

import os

import _gpu_paths  # noqa: F401  (puts tests/integration/scripts on the path)
import torch
import torch.distributed as dist
from _it_common import outdir_from_argv
from fsdp_train import SEED, batch, make_model
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fabric import Fabric

STEPS = 4


def train(model: nn.Module, optimizer: torch.optim.Optimizer, fabric: Fabric, raw: bool) -> list[float]:
    losses = []
    for step in range(STEPS):
        x, y = (t.to(fabric.device) for t in batch(step, fabric.global_rank))
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward() if raw else fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    outdir = outdir_from_argv()
    # Deterministic cuBLAS, so that the two runs may be compared bit for bit (set before CUDA starts).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    fabric = Fabric(accelerator="cuda", strategy="ddp", devices=2)
    fabric.launch()
    rank, device = fabric.global_rank, fabric.device
    results: dict = {"backend": str(dist.get_backend()), "device": str(device)}
    results["current_device"] = torch.cuda.current_device()

    torch.manual_seed(SEED)
    raw = DistributedDataParallel(make_model().to(device), device_ids=[device.index])
    raw_losses = train(raw, torch.optim.SGD(raw.parameters(), lr=0.1, momentum=0.9), fabric, raw=True)
    torch.manual_seed(SEED)
    model = make_model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    losses = train(model, optimizer, fabric, raw=False)
    results["raw"] = {"losses": raw_losses, "weights": {k: v.cpu() for k, v in raw.module.state_dict().items()}}
    results["fabric"] = {"losses": losses, "weights": {k: v.cpu() for k, v in model.state_dict().items()}}
    results["param_devices"] = sorted({str(p.device) for p in model.parameters()})

    fabric.barrier()
    results["broadcast"] = fabric.broadcast({"from": rank}, src=1)
    gathered = fabric.all_gather(torch.tensor([rank], device=device))
    results["all_gather"] = (gathered.device.type, gathered.flatten().tolist())
    uneven = fabric.all_gather(torch.arange(rank + 1, device=device), uneven=True)  # shapes (1,), (2,): a list
    results["all_gather_uneven"] = [(part.device.type, part.tolist()) for part in uneven]
    reduced = fabric.all_reduce(torch.tensor(float(rank + 1), device=device), reduce_op="sum")
    results["all_reduce"] = (reduced.device.type, reduced.item())
    results["any"] = fabric.strategy.reduce_boolean_decision(rank == 1, all=False)  # type: ignore[attr-defined]

    extra = torch.arange(3.0, device=device)
    fabric.save(outdir / "ddp.ckpt", {"model": model, "optimizer": optimizer, "step": STEPS, "extra": extra})
    fresh = make_model()
    fresh, fresh_optimizer = fabric.setup(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9))
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0, "extra": None}
    fabric.load(outdir / "ddp.ckpt", state)
    results["loaded"] = {
        "weights_equal": all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters(), strict=True)),
        "param_devices": sorted({str(p.device) for p in fresh.parameters()}),
        "momentum_devices": sorted({str(s["momentum_buffer"].device) for s in fresh_optimizer.state.values()}),
        "step": state["step"],
        "extra": state["extra"].cpu().tolist(),
    }
    torch.save(results, outdir / f"rank{rank}.pt")


if __name__ == "__main__":
    main()

"""DeepSpeed ZeRO stage 2 with optimizer offload, precision='16-mixed', on 2 GPUs: DeepSpeed's dynamic loss scale.

Usage: python gpu_deepspeed_fp16.py OUTDIR
A step whose loss is multiplied by inf must be skipped (weights unchanged) and halve the scale; finite steps train;
clip_gradients works; the scale comes back from a checkpoint. Each rank writes OUTDIR/rank{N}.pt.
"""

from __future__ import annotations

from typing import Any

import _gpu_paths  # noqa: F401
import torch
from _it_common import outdir_from_argv
from torch import nn

from fabric import Fabric
from fabric.strategies import DeepSpeedStrategy


def loss_scale(fabric: Fabric) -> float:
    engine: Any = fabric.strategy.engine  # type: ignore[attr-defined]
    optimizer = engine.optimizer
    value = getattr(optimizer, "loss_scale", None)
    return float(value if value is not None else optimizer.cur_scale)


def make(outdir: Any) -> tuple[Fabric, Any, Any]:
    # A torch optimizer with optimizer offload needs DeepSpeed's permission (its CPUAdam would compile an op).
    # hysteresis=1: the first overflow lowers the scale (DeepSpeed's default, 2, waits for a second one).
    strategy = DeepSpeedStrategy(
        stage=2, offload_optimizer=True, hysteresis=1, config={"zero_force_ds_cpu_optimizer": False}
    )
    fabric = Fabric(accelerator="cuda", devices=2, strategy=strategy, precision="16-mixed")
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return fabric, model, optimizer


def weights(model: Any) -> list[torch.Tensor]:
    return [p.detach().float().cpu().clone() for p in model.parameters()]


def main() -> None:
    outdir = outdir_from_argv()
    fabric, model, optimizer = make(outdir)
    x = torch.randn(16, 32, device=fabric.device)
    y = torch.randint(0, 4, (16,), device=fabric.device)
    result: dict[str, Any] = {"param_dtypes": sorted({str(p.dtype) for p in model.parameters()}), "losses": []}
    for step in range(6):
        loss = nn.functional.cross_entropy(model(x).float(), y)
        if step == 3:
            before, scale_before = weights(model), loss_scale(fabric)
            fabric.backward(loss * float("inf"))
            optimizer.step()
            result["overflow"] = {
                "weights_unchanged": all(torch.equal(a, b) for a, b in zip(before, weights(model), strict=True)),
                "scale_before": scale_before,
                "scale_after": loss_scale(fabric),
            }
            continue
        fabric.backward(loss)
        result["norm"] = float(fabric.clip_gradients(model, optimizer, max_norm=1.0))
        optimizer.step()
        result["losses"].append(loss.item())
    result["scale"] = loss_scale(fabric)
    fabric.save(outdir / "ds_ckpt", {"model": model, "optimizer": optimizer})
    other, model_b, optimizer_b = make(outdir)  # joins the existing process group
    other.load(outdir / "ds_ckpt", {"model": model_b, "optimizer": optimizer_b})
    result["resumed_scale"] = loss_scale(other)
    torch.save(result, outdir / f"rank{fabric.global_rank}.pt")


if __name__ == "__main__":
    main()

"""Training a model created under fabric.init_module() with DeepSpeed ZeRO 1-3, in every precision, on 2 CPU ranks.

Usage: python ds_init_module.py OUTDIR
The ranks first make DeepSpeed's CPU accelerator report no float16 support, as on CPUs without oneDNN float16:
there, DeepSpeed's zero.Init turned an explicit dtype into bfloat16, and a float32 model built under
init_module with stage 3 failed at its first forward. Then, with the machine's real answer, float16 ('16-true')
either trains or fails with fabric's message. Results: OUTDIR/rank{N}.pt, {run name: observations or {"error": ...}}.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _it_common import free_port, import_before_fork, outdir_from_argv
from torch import nn

from fabric import Fabric
from fabric.precision import DeepSpeedPrecision
from fabric.strategies.deepspeed import DeepSpeedStrategy

STEPS = 4
LR = 0.05


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's batch; the same at every step, so the loss must fall."""
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)


def ddp_run(rank: int, initial: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """The reference: torch DDP in float32 from the same initial weights (make_model's, or `initial`) and batches."""
    reference = make_model()
    if initial is not None:
        reference.load_state_dict(initial)
    model = nn.parallel.DistributedDataParallel(reference)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        x, y = batch(rank)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "weights": {k: v.clone() for k, v in model.module.state_dict().items()}}


def ds_run(stage: int, precision: str, rank: int, outdir: Path, as_plugin: bool = False) -> dict[str, Any]:
    strategy = DeepSpeedStrategy(stage=stage)
    if as_plugin:  # Lightning's spelling: the plugin instead of the name
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[DeepSpeedPrecision(precision)])
    else:
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision=precision)
    fabric.launch()
    with fabric.init_module():
        model = make_model()
    partitioned = all(hasattr(p, "ds_id") for p in model.parameters())
    initial = initial_weights(model, partitioned)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = fabric.setup(model, optimizer)
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    losses = []
    for _ in range(STEPS):
        x, y = batch(rank)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    path = outdir / f"stage{stage}_{precision}_{as_plugin}"
    fabric.save(path, {"model": model, "optimizer": optimizer})
    from fabric.strategies.deepspeed.checkpoint import consolidate_deepspeed

    weights = {k: v.float() for k, v in consolidate_deepspeed(path)["model"].items()}
    fabric.strategy.teardown()
    reference = ddp_run(rank, initial)
    return {"losses": losses, "weights": weights, "partitioned": partitioned, "dtypes": dtypes, "reference": reference}


def initial_weights(model: nn.Module, partitioned: bool) -> dict[str, torch.Tensor]:
    """The weights init_module drew, in float32. In 16 bits they are not make_model()'s float32 draws rounded: how
    many random numbers uniform_ takes per element in bfloat16 differs between torch releases (2.9 and 2.13)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=partitioned):
        return {name: value.detach().float().clone() for name, value in model.state_dict().items()}


def guarded(fn: Any, *args: Any) -> dict[str, Any]:
    try:
        return fn(*args)
    except Exception as err:
        return {"error": traceback.format_exc(), "message": f"{type(err).__name__}: {err}"}


def rank_main(rank: int, port: int, outdir: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", NODE_RANK="0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from deepspeed.accelerator import get_accelerator

    accelerator_class = type(get_accelerator())
    real_fp16 = accelerator_class.is_fp16_supported
    fp16_supported = bool(get_accelerator().is_fp16_supported())
    results: dict[str, Any] = {"ddp": guarded(ddp_run, rank), "fp16_supported": fp16_supported}
    try:
        accelerator_class.is_fp16_supported = lambda self: False  # type: ignore[method-assign]
        for precision in ("32-true", "bf16-mixed", "bf16-true", "16-true"):
            for stage in (1, 2, 3):
                results[f"nofp16_stage{stage}_{precision}"] = guarded(ds_run, stage, precision, rank, outdir)
                dist.barrier()
        results["plugin_stage3_bf16-mixed"] = guarded(ds_run, 3, "bf16-mixed", rank, outdir, True)
        dist.barrier()
        accelerator_class.is_fp16_supported = real_fp16  # type: ignore[method-assign]
        for stage in (1, 2, 3):
            results[f"stage{stage}_16-true"] = guarded(ds_run, stage, "16-true", rank, outdir)
            dist.barrier()
    finally:
        torch.save(results, outdir / f"rank{rank}.pt")
        dist.destroy_process_group()


def main() -> None:
    outdir = outdir_from_argv()
    port = free_port()
    import_before_fork("deepspeed")  # ~0.9 CPU-s more per rank otherwise
    context = mp.get_context("fork")
    procs = [context.Process(target=rank_main, args=(rank, port, outdir)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    if any(proc.exitcode != 0 for proc in procs):
        raise SystemExit(f"rank exit codes: {[proc.exitcode for proc in procs]}")


if __name__ == "__main__":
    main()

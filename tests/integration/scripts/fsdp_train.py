"""FSDP (FSDP2 fully_shard) training on 2 CPU ranks, checked against raw DDP in the same process group.

Usage: python fsdp_train.py OUTDIR
Each rank writes OUTDIR/rank{N}.pt: check name -> what this rank observed (or {"error": traceback}). Every check
starts from the same seed and feeds the same global batches (each rank its half), so the raw DDP run is the
reference the test compares against.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _it_common import outdir_from_argv, run_each
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fabric import Fabric
from fabric.strategies import FSDPStrategy

SEED = 1234
STEPS = 4
PER_RANK = 8


class Block(nn.Module):
    """A residual MLP block: the unit the auto-wrap and checkpointing policies pick."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.inner(x))


def make_model() -> nn.Module:
    # 5 outputs: the last layer does not split evenly over 2 ranks, which FSDP2 pads.
    return nn.Sequential(nn.Linear(16, 32), Block(32), Block(32), nn.Linear(32, 5))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(2 * PER_RANK, 16, generator=generator)
    y = torch.randn(2 * PER_RANK, 5, generator=generator)
    return x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK]


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded copies of every parameter (a collective for sharded ones)."""
    module = getattr(model, "module", model)  # behind DDP or fabric's wrapper
    out = {}
    for name, param in module.named_parameters():
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[name] = value.detach().clone()
    return out


def global_loss(loss: torch.Tensor) -> float:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def train(model: Any, optimizer: Any, rank: int, step_fn: Callable[..., None], **options: Any) -> dict[str, Any]:
    losses, norms = [], []
    accumulate = options.get("accumulate", False)
    for step in range(STEPS):
        x, y = batch(step, rank)
        if accumulate:
            step_fn(model, x[:4], y[:4], sync=False)
            losses.append(step_fn(model, x[4:], y[4:], sync=True))
        else:
            losses.append(step_fn(model, x, y, sync=True))
        if options.get("clip"):
            norms.append(float(options["clip"](model, optimizer)))
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "norms": norms, "weights": full_weights(model)}


# -- reference: raw DDP on the process group fabric created --------------------------------------------
def ddp_reference(fabric: Fabric, accumulate: bool = False, clip: bool = False) -> dict[str, Any]:
    torch.manual_seed(SEED)
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(model: Any, x: torch.Tensor, y: torch.Tensor, sync: bool) -> float:
        with model.no_sync() if not sync else torch.enable_grad():
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
        return global_loss(loss)

    def clip_fn(model: Any, optimizer: Any) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)

    return train(model, optimizer, fabric.global_rank, step, accumulate=accumulate, clip=clip_fn if clip else None)


def fabric_step(fabric: Fabric) -> Callable[..., float]:
    def step(model: Any, x: torch.Tensor, y: torch.Tensor, sync: bool) -> float:
        with fabric.no_backward_sync(model, enabled=not sync):
            loss = nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
        return global_loss(loss)

    return step


def fsdp_run(fabric: Fabric, joint: bool = False, accumulate: bool = False, clip: bool = False) -> dict[str, Any]:
    fabric.seed_everything(SEED, verbose=False)
    model = make_model()
    if joint:  # optimizer built on the unsharded parameters, rebound by fabric.setup
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = fabric.setup(model, optimizer)
    else:
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    clip_fn = (lambda m, o: fabric.clip_gradients(m, o, max_norm=0.5)) if clip else None
    result = train(model, optimizer, fabric.global_rank, fabric_step(fabric), accumulate=accumulate, clip=clip_fn)
    result["param_types"] = sorted({type(p).__name__ for p in model.parameters()})
    result["local_numel"] = sum(p.to_local().numel() for p in model.parameters())
    return result


# -- checks ----------------------------------------------------------------------------------------------
def parity(fabric: Fabric) -> Any:
    return {"ddp": ddp_reference(fabric), "separate": fsdp_run(fabric), "joint": fsdp_run(fabric, joint=True)}


def clipping(fabric: Fabric) -> Any:
    return {"ddp": ddp_reference(fabric, clip=True), "fsdp": fsdp_run(fabric, clip=True)}


def accumulation(fabric: Fabric) -> Any:
    return {"ddp": ddp_reference(fabric, accumulate=True), "fsdp": fsdp_run(fabric, accumulate=True)}


def options(fabric: Fabric) -> Any:
    """Auto-wrap, activation checkpointing and CPU offload change memory use, not the math."""
    strategy = FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block}, cpu_offload=True)
    other = Fabric(accelerator="cpu", strategy=strategy, devices=2)
    other.launch()
    result = fsdp_run(other)
    model = other.setup_module(make_model())
    result["wrapped"] = sorted(type(m).__name__ for m in model.modules() if type(m).__name__.startswith("FSDP"))
    return result


def empty_init(fabric: Fabric) -> Any:
    fabric.seed_everything(SEED, verbose=False)
    with fabric.init_module(empty_init=True):
        model = make_model()
    on_meta = all(p.is_meta for p in model.parameters())
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    initial = full_weights(model)
    local = {name: p.to_local().detach().clone() for name, p in model.module.named_parameters()}
    result = train(model, optimizer, fabric.global_rank, fabric_step(fabric))
    return {"on_meta": on_meta, "initial": initial, "local": local, "losses": result["losses"]}


def bf16_mixed(fabric: Fabric) -> Any:
    other = Fabric(accelerator="cpu", strategy="fsdp", devices=2, precision="bf16-mixed")
    other.launch()
    seen = {}

    def record_dtype(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        seen["weight_dtype_in_forward"] = str(module.weight.dtype)

    other.seed_everything(SEED, verbose=False)
    model = other.setup_module(make_model())
    model.module[0].register_forward_hook(record_dtype)
    optimizer = other.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    result = train(model, optimizer, other.global_rank, fabric_step(other))
    result["shard_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    return {**result, **seen}


def checkpoint(fabric: Fabric, outdir: Path) -> Any:
    fabric.seed_everything(SEED, verbose=False)
    model = fabric.setup_module(make_model())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    train(model, optimizer, fabric.global_rank, fabric_step(fabric))
    saved = full_weights(model)
    fabric.save(outdir / "ckpt", {"model": model, "optimizer": optimizer, "step": STEPS})
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(outdir / "ckpt", state)
    optimizer_keys = sorted(optimizer.state_dict()["state"])  # collective; keyed by parameter names
    return {"saved": saved, "loaded": full_weights(model), "step": state["step"], "optimizer_keys": optimizer_keys}


def full_checkpoint(fabric: Fabric, outdir: Path) -> Any:
    other = Fabric(accelerator="cpu", strategy=FSDPStrategy(state_dict_type="full"), devices=2)
    other.launch()
    other.seed_everything(SEED, verbose=False)
    model = other.setup_module(make_model())
    saved = full_weights(model)
    other.save(outdir / "full.ckpt", {"model": model, "step": 3})
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    state = {"model": model, "step": 0}
    other.load(outdir / "full.ckpt", state)
    return {"is_file": (outdir / "full.ckpt").is_file(), "saved": saved, "loaded": full_weights(model)}


CHECKS: dict[str, Callable[..., Any]] = {
    "parity": parity,
    "clipping": clipping,
    "accumulation": accumulation,
    "options": options,
    "empty_init": empty_init,
    "bf16_mixed": bf16_mixed,
    "checkpoint": checkpoint,
    "full_checkpoint": full_checkpoint,
}


def main() -> None:
    outdir = outdir_from_argv()
    fabric = Fabric(accelerator="cpu", strategy="fsdp", devices=2)
    fabric.launch()

    def call(check: Callable[..., Any]) -> Any:  # the checkpoint checks also write to OUTDIR
        return check(fabric, outdir) if check in (checkpoint, full_checkpoint) else check(fabric)

    results = run_each(CHECKS, call, fabric.barrier)
    torch.save(results, outdir / f"rank{fabric.global_rank}.pt")


if __name__ == "__main__":
    main()

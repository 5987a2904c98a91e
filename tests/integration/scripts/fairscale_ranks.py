"""ddp_sharded (fairscale OSS + ShardedDataParallel) on two CPU ranks over gloo, next to torch's DDP.

Usage: python fairscale_ranks.py OUTDIR
The parent forks two ranks that join one gloo group (fabric joins it) and run every check with fresh Fabric
objects; then it loads their checkpoint in a single process. Results: OUTDIR/rank{N}.pt and OUTDIR/single.pt,
dicts from check name to observations, or {"error": traceback}.
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _it_common import free_port, import_before_fork, outdir_from_argv, run_each
from torch import Tensor, nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from fabric import Fabric
from fabric.precision import MixedPrecision
from fabric.strategies.fairscale import DDPShardedStrategy

STEPS = 4
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.05),
}


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))


def loss_of(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    """Each rank's own batch for this step, the same in every run."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)
    return nn.functional.cross_entropy(model(x), y)


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(
    model: nn.Module,
    optimizer: Any,
    rank: int,
    backward: Callable[[torch.Tensor], None],
    clip: Callable[[], float] | None = None,
    no_sync: Callable[[], Any] | None = None,
    autocast: Callable[[], Any] | None = None,
    evaluate: bool = False,
) -> dict[str, Any]:
    """The user's loop, with the default optimizer.zero_grad() (set_to_none=True in torch 2)."""
    losses, norms = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        if no_sync is not None:
            with no_sync():
                backward(loss_of(model, 100 + step, rank))  # an accumulated micro-batch
        with autocast() if autocast is not None else torch.autocast("cpu", enabled=False):
            loss = loss_of(model, step, rank)
        backward(loss)
        if clip is not None:
            norms.append(float(clip()))
        optimizer.step()
        losses.append(loss.item())
        if evaluate:  # a validation batch in eval mode (ShardedDataParallel rebuilds its buckets on the switches)
            model.eval()
            with torch.no_grad():
                losses.append(loss_of(model, 200 + step, rank).item())
            model.train()
    return {"losses": losses, "norms": norms}


class _Scaled:
    """A plain optimizer stepped through torch's GradScaler, as a raw float16 AMP loop does."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer, self.scaler = optimizer, torch.amp.GradScaler("cpu")

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> None:
        self.scaler.step(self.optimizer)
        self.scaler.update()


class _Cast(nn.Module):
    """Casts floating inputs (what fabric's 16-true precision does to inputs and outputs)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: Tensor) -> Tensor:
        return x.to(self.dtype)


def ddp_run(rank: int, optimizer_name: str = "adamw", **options: Any) -> dict[str, Any]:
    """The reference: torch's DDP and a plain optimizer on the same group, data and seed."""
    true_dtype = options.get("true_dtype")
    if true_dtype is not None:
        inner = make_model().to(true_dtype)
        model = nn.parallel.DistributedDataParallel(nn.Sequential(_Cast(true_dtype), inner, _Cast(torch.float32)))
        optimizer = OPTIMIZERS[optimizer_name](model.parameters())
        result = train(model, optimizer, rank, Tensor.backward)
        return {**result, "weights": weights(inner), "optimizer": optimizer.state_dict()}
    model = nn.parallel.DistributedDataParallel(make_model())
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    clip = (lambda: nn.utils.clip_grad_norm_(model.parameters(), options["clip"])) if "clip" in options else None
    dtype = options.get("autocast")
    autocast = (lambda: torch.autocast("cpu", dtype=dtype)) if dtype is not None else None
    no_sync = model.no_sync if options.get("accumulate") else None
    evaluate = bool(options.get("evaluate"))
    stepper: Any = _Scaled(optimizer) if dtype == torch.float16 else optimizer
    backward = (lambda loss: stepper.scaler.scale(loss).backward()) if dtype == torch.float16 else Tensor.backward
    result = train(model, stepper, rank, backward, clip, no_sync, autocast, evaluate)
    return {**result, "weights": weights(model.module), "optimizer": optimizer.state_dict()}


def fabric_for(precision: Any = "32-true", **kwargs: Any) -> Fabric:
    plugins = [precision] if isinstance(precision, MixedPrecision) else None
    precision = None if plugins else precision
    fabric = Fabric(
        accelerator="cpu", devices=2, strategy=DDPShardedStrategy(**kwargs), precision=precision, plugins=plugins
    )
    fabric.launch()
    return fabric


def sharded_run(rank: int, optimizer_name: str = "adamw", precision: Any = "32-true", **options: Any) -> dict[str, Any]:
    fabric = fabric_for(precision, **options.pop("strategy", {}))
    model = make_model()
    model, optimizer = fabric.setup(model, OPTIMIZERS[optimizer_name](model.parameters()))
    clip = (lambda: fabric.clip_gradients(model, optimizer, max_norm=options["clip"])) if "clip" in options else None
    no_sync = (lambda: fabric.no_backward_sync(model)) if options.get("accumulate") else None
    result = train(model, optimizer, rank, fabric.backward, clip, no_sync, evaluate=bool(options.get("evaluate")))
    return {**result, "weights": weights(model), "optimizer": optimizer.state_dict()}


def raw_fairscale_run(rank: int) -> dict[str, Any]:
    """fairscale alone, with gradient buckets and the default zero_grad: the drift fabric removes."""
    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim import OSS

    inner = make_model()
    optimizer = OSS(inner.parameters(), optim=torch.optim.AdamW, lr=0.05)
    model = ShardedDataParallel(inner, optimizer, reduce_buffer_size=2**23)
    result = train(model, optimizer, rank, lambda loss: loss.backward())
    return {**result, "weights": weights(inner)}


def parity(rank: int, outdir: Path) -> dict[str, Any]:
    """Weights and losses after STEPS steps: DDP, ddp_sharded with and without buckets, raw fairscale."""
    result: dict[str, Any] = {"raw_fairscale": raw_fairscale_run(rank)}
    for name in OPTIMIZERS:
        result[f"ddp_{name}"] = ddp_run(rank, name)
        result[f"sharded_{name}"] = sharded_run(rank, name)
        # One bucket per owner (fairscale's own default size), and a small one that holds only some gradients.
        result[f"buckets_{name}"] = sharded_run(rank, name, strategy={"reduce_buffer_size": 2**23})
        result[f"small_buckets_{name}"] = sharded_run(rank, name, strategy={"reduce_buffer_size": 200})
    result["ddp_accumulate"] = ddp_run(rank, accumulate=True)
    result["sharded_accumulate"] = sharded_run(rank, accumulate=True)
    result["buckets_accumulate"] = sharded_run(rank, accumulate=True, strategy={"reduce_buffer_size": 2**23})
    result["ddp_evaluate"] = ddp_run(rank, evaluate=True)
    result["buckets_evaluate"] = sharded_run(rank, evaluate=True, strategy={"reduce_buffer_size": 2**23})
    result["ddp_clip"] = ddp_run(rank, clip=0.05)
    result["sharded_clip"] = sharded_run(rank, clip=0.05)
    result["ddp_bf16"] = ddp_run(rank, autocast=torch.bfloat16)
    result["sharded_bf16"] = sharded_run(rank, precision="bf16-mixed")
    result["ddp_bf16_true"] = ddp_run(rank, true_dtype=torch.bfloat16)
    result["sharded_bf16_true"] = sharded_run(rank, precision="bf16-true", strategy={"reduce_buffer_size": 2**23})
    # float16 AMP with a loss scaler: the sharded scaler agrees across ranks on skipping a step with inf gradients.
    result["ddp_fp16"] = ddp_run(rank, autocast=torch.float16)
    scaled = MixedPrecision("16-mixed", "cpu", scaler=ShardedGradScaler("cpu"))
    result["sharded_fp16"] = sharded_run(rank, precision=scaled, strategy={"reduce_buffer_size": 2**23})
    result["fp16_scale"] = scaled.scaler.get_scale()
    return result


def scheduler(rank: int, outdir: Path) -> dict[str, Any]:
    """An LR scheduler created on the user's optimizer before setup steers the sharded optimizer."""
    runs = {}
    for name in ("ddp", "sharded"):
        if name == "ddp":
            model: Any = nn.parallel.DistributedDataParallel(make_model())
            optimizer: Any = torch.optim.SGD(model.parameters(), lr=0.1)
            schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            backward: Callable[[torch.Tensor], None] = lambda loss: loss.backward()  # noqa: E731
        else:
            fabric = fabric_for()
            model = make_model()
            plain = torch.optim.SGD(model.parameters(), lr=0.1)
            schedule = torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.5)
            model, optimizer = fabric.setup(model, plain)
            backward = fabric.backward
        for step in range(STEPS):
            optimizer.zero_grad()
            backward(loss_of(model, step, rank))
            optimizer.step()
            schedule.step()
        runs[name] = {
            "weights": weights(model.module if name == "ddp" else model),
            "lr": optimizer.param_groups[0]["lr"],
        }
    return runs


def checkpoint(rank: int, outdir: Path) -> dict[str, Any]:
    """Save after 2 steps (rank 0 gathers the optimizer shards), resume in a fresh run, compare the 3rd step."""
    fabric = fabric_for()
    model = make_model()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.05))
    for step in range(2):
        optimizer.zero_grad()
        fabric.backward(loss_of(model, step, rank))
        optimizer.step()
    path = outdir / "sharded.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
    expected = loss_of(model, 2, rank).item()
    optimizer.zero_grad()
    fabric.backward(loss_of(model, 2, rank))
    optimizer.step()
    after_step3 = weights(model)

    fabric2 = fabric_for()
    model2 = make_model(seed=7)
    model2, optimizer2 = fabric2.setup(model2, torch.optim.AdamW(model2.parameters(), lr=0.05))
    state: dict[str, Any] = {"model": model2, "optimizer": optimizer2, "step": 0}
    fabric2.load(path, state)
    observed = loss_of(model2, 2, rank).item()
    optimizer2.zero_grad()
    fabric2.backward(loss_of(model2, 2, rank))
    optimizer2.step()
    # The reference for the file's optimizer entry: DDP after the same 2 steps.
    model3 = nn.parallel.DistributedDataParallel(make_model())
    optimizer3 = torch.optim.AdamW(model3.parameters(), lr=0.05)
    for step in range(2):
        optimizer3.zero_grad()
        loss_of(model3, step, rank).backward()
        optimizer3.step()
    return {
        "expected": expected,
        "observed": observed,
        "step": state["step"],
        "resumed_equal": all(torch.equal(after_step3[k], v) for k, v in weights(model2).items()),
        "ddp_optimizer": optimizer3.state_dict(),
        "ddp_weights": weights(model3.module),
    }


def error_of(fn: Callable[[], Any]) -> str | None:
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def errors(rank: int, outdir: Path) -> dict[str, Any]:
    """Each misuse gives its message on every rank, without a hang."""
    from fairscale.nn import FullyShardedDataParallel

    fabric = fabric_for()
    foreign = torch.optim.SGD(make_model().parameters(), lr=0.1)
    plain = torch.optim.SGD(make_model().parameters(), lr=0.1)
    model = make_model()
    partly_foreign = torch.optim.SGD([*model.parameters(), *make_model().parameters()], lr=0.1)
    result = {
        "foreign_optimizer": error_of(lambda: fabric.setup(make_model(), foreign)),
        "partly_foreign_optimizer": error_of(lambda: fabric.setup(model, partly_foreign)),
        "setup_module": error_of(lambda: fabric.setup_module(make_model())),
        "setup_without_optimizer": error_of(lambda: fabric.setup(make_model())),
        "setup_optimizers": error_of(lambda: fabric.setup_optimizers(plain)),
    }
    inner = FullyShardedDataParallel(nn.Linear(2, 2))
    fsdp_model = nn.Sequential(inner, nn.Linear(2, 2))
    fsdp_optimizer = torch.optim.SGD(fsdp_model.parameters(), lr=0.1)
    result["fairscale_fsdp"] = error_of(lambda: fabric.setup(fsdp_model, fsdp_optimizer))
    model = make_model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.backward(loss_of(model, 0, rank) * float("inf"))
    result["nonfinite_clip"] = error_of(lambda: fabric.clip_gradients(model, optimizer, max_norm=1.0))
    result["plain_optimizer_clip"] = error_of(
        lambda: fabric.strategy.clip_gradients_norm(model, plain, 1.0, 2.0, True)  # not the one setup returned
    )
    return result


CHECKS = {"parity": parity, "scheduler": scheduler, "checkpoint": checkpoint, "errors": errors}


def rank_main(rank: int, port: int, outdir: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", NODE_RANK="0")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results: dict[str, Any] = {}
    try:
        run_each(CHECKS, lambda check: check(rank, outdir), dist.barrier, results)
    finally:
        torch.save(results, outdir / f"rank{rank}.pt")
        dist.destroy_process_group()


def single_process(outdir: Path) -> dict[str, Any]:
    """The 2-rank checkpoint in one process: into a plain optimizer, and into ddp_sharded on 1 rank."""
    checkpoint = torch.load(outdir / "sharded.ckpt", weights_only=True)
    model = make_model(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    loss = loss_of(model, 2, 0)
    loss.backward()
    optimizer.step()  # the loaded state must be usable by a plain optimizer
    fabric = Fabric(accelerator="cpu", devices=1, strategy="ddp_sharded")
    fabric.launch()
    sharded_model = make_model(seed=5)
    sharded_model, sharded_optimizer = fabric.setup(sharded_model, torch.optim.AdamW(sharded_model.parameters()))
    state: dict[str, Any] = {"model": sharded_model, "optimizer": sharded_optimizer}
    fabric.load(outdir / "sharded.ckpt", state)
    result = {
        "stepped_state": optimizer.state_dict(),
        "sharded_state": sharded_optimizer.state_dict(),
        "sharded_weights": weights(sharded_model),
        "file": torch.load(outdir / "sharded.ckpt", weights_only=True),  # `checkpoint` was stepped in place
    }
    fabric.strategy.teardown()
    return result


def main() -> None:
    outdir = outdir_from_argv()
    port = free_port()
    import_before_fork()  # this process imports it for its own single-process check anyway
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

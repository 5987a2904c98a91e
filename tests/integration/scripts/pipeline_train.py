"""PipelineStrategy on 2 CPU ranks: GPipe, 1F1B and Interleaved1F1B against one-process training, plus bad input.

Usage: python pipeline_train.py OUTDIR
Each rank writes OUTDIR/rank{N}.pt: check name -> what this rank observed (or {"error": traceback}); the 1F1B check
also saves OUTDIR/ckpt, which the test loads whole in its own process.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _it_common import run_checks
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric
from fabric.strategies import PipelineStrategy

VOCAB, DIM, SEQ, BATCH, STEPS = 16, 8, 6, 8, 3


class Block(nn.Module):
    """A pre-norm residual MLP block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TinyGPT(nn.Module):
    """The usual layout: embedding, a ModuleList of blocks, final norm and head; skips what another stage runs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) if self.embed is not None else tokens
        for block in self.blocks:
            h = block(h)
        h = self.norm(h) if self.norm is not None else h
        return self.head(h) if self.head is not None else h


def make_sequential() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def make_gpt() -> nn.Module:
    torch.manual_seed(0)
    return TinyGPT()


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def regression_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)) for _ in range(STEPS)]


def token_loader() -> DataLoader:
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (BATCH * STEPS, SEQ + 1), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)


def train(fabric: Fabric | None, model: Any, optimizer: Any, batches: Any, loss_fn: Callable, clip: bool) -> Any:
    """Fabric's pipeline loop, or (fabric=None) plain one-process training on the same batches."""
    losses, norms = [], []
    for x, y in batches:
        if fabric is not None:
            loss = fabric.pipeline_step(model, x, target=y)
            norm = fabric.clip_gradients(model, optimizer, max_norm=0.5) if clip else None
        else:
            loss = loss_fn(model(x), y)
            loss.backward()
            norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5) if clip else None
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
        norms.append(norm)
    return {"losses": losses, "norms": norms, "weights": {k: v.clone() for k, v in model.state_dict().items()}}


def compare(
    make: Callable[[], nn.Module], split: list[str], schedule: str, loss_fn: Callable, batches: Any, clip: bool
) -> tuple[Fabric, Any, Any, dict[str, Any]]:
    strategy = PipelineStrategy(split_points=split, schedule=schedule, microbatches=4, loss_fn=loss_fn)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = make()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    result = train(fabric, model, optimizer, batches, loss_fn, clip)
    reference = make()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    expected = train(None, reference, ref_optimizer, batches, loss_fn, clip)
    momentum = {n: ref_optimizer.state[p]["momentum_buffer"].clone() for n, p in reference.named_parameters()}
    return fabric, model, optimizer, {"fabric": result, "reference": expected, "momentum": momentum}


def gpipe_sequential(outdir: Path) -> Any:
    return compare(make_sequential, ["2"], "GPipe", mse, regression_batches(), clip=False)[3]


def other_schedules(outdir: Path) -> Any:
    """The remaining multi-stage schedules, 4 stages of the Sequential on 2 ranks."""
    batches = regression_batches()
    return {name: compare(make_sequential, ["1", "2", "3"], name, mse, batches, clip=False)[3]
            for name in ("LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")}  # fmt: skip


def one_f_one_b_gpt(outdir: Path) -> Any:
    fabric, model, optimizer, result = compare(make_gpt, ["blocks.2"], "1F1B", token_loss, list(token_loader()), True)
    fabric.save(outdir / "ckpt", {"model": model, "optimizer": optimizer, "step": STEPS})
    return result


def interleaved_gpt(outdir: Path) -> Any:
    split = ["blocks.1", "blocks.2", "blocks.3"]  # 4 stages, 2 per rank
    return compare(make_gpt, split, "interleaved1f1b", token_loss, list(token_loader()), clip=True)[3]


def resume_in_another_split(outdir: Path) -> Any:
    """The 1F1B checkpoint (split at blocks.2) into a GPipe pipeline split at blocks.1; then a model it does not fit."""
    strategy = PipelineStrategy(split_points=["blocks.1"], schedule="GPipe", microbatches=4, loss_fn=token_loss)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = make_gpt()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    remainder = fabric.load(outdir / "ckpt", {"model": model, "optimizer": optimizer})
    momentum = {n: optimizer.state[p]["momentum_buffer"].clone() for n, p in model.module.named_parameters()}
    smaller = make_gpt()
    del smaller.blocks[3]
    smaller = fabric.setup(smaller)
    try:
        fabric.load(outdir / "ckpt", {"model": smaller})
        mismatch = ""
    except RuntimeError as err:
        mismatch = str(err)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    return {"remainder": remainder, "weights": weights, "momentum": momentum, "mismatch": mismatch}


def bf16_mixed(outdir: Path) -> Any:
    """Autocast runs inside every stage; the loss function gets float32 outputs."""
    strategy = PipelineStrategy(split_points=["2"], schedule="GPipe", microbatches=4, loss_fn=mse)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="bf16-mixed")
    fabric.launch()
    model = make_sequential()
    dtypes: list[torch.dtype] = []
    for layer in (model[0], model[4]):
        layer.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    model = fabric.setup(model)
    x, y = regression_batches()[0]
    loss = fabric.pipeline_step(model, x, target=y)
    return {"loss": loss, "reference": mse(make_sequential()(x), y), "dtypes": sorted(set(map(str, dtypes)))}


def double_true(outdir: Path) -> Any:
    """64-true: every stage holds float64 parameters, and training matches a float64 model in one process."""
    strategy = PipelineStrategy(split_points=["2"], schedule="1F1B", microbatches=4, loss_fn=mse)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="64-true")
    fabric.launch()
    model = make_sequential()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    batches = [(x.double(), y.double()) for x, y in regression_batches()]
    result = train(fabric, model, optimizer, batches, mse, clip=True)
    reference = make_sequential().double()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    return {"dtypes": dtypes, "fabric": result, "reference": train(None, reference, ref_optimizer, batches, mse, True)}


def meta_init(outdir: Path) -> Any:
    """init_module(empty_init=True): no rank ever holds the whole model; each initialises its own stage."""
    strategy = PipelineStrategy(split_points=["blocks.2"], schedule="1F1B", microbatches=4, loss_fn=token_loss)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = TinyGPT()
    on_meta = all(p.is_meta for p in model.parameters())
    model = fabric.setup(model)
    x, y = next(iter(token_loader()))
    loss = fabric.pipeline_step(model, x, target=y)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    # Four equal layers, two per stage: each layer draws its own values, not the other stage's again.
    fabric = Fabric(accelerator="cpu", devices=2, strategy=PipelineStrategy(split_points=["2"], loss_fn=mse))
    fabric.launch()
    fabric.seed_everything(0, verbose=False)  # the same random state on both ranks, as in a seeded script
    with fabric.init_module(empty_init=True):
        layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    layers = fabric.setup(layers)
    return {
        "on_meta": on_meta, "finite": finite, "loss": float(loss), "names": sorted(model.state_dict()),
        "layers": {k: v.clone() for k, v in layers.state_dict().items()},
    }  # fmt: skip


def loader_and_bad_input(outdir: Path) -> Any:
    strategy = PipelineStrategy(split_points=["2"], schedule="1F1B", microbatches=4, loss_fn=mse)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup(make_sequential())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    batches = [x for x, _ in fabric.setup_dataloaders(token_loader())]
    raised: dict[str, str] = {}
    too_few = PipelineStrategy(split_points=["2"], schedule="1F1B", microbatches=1, loss_fn=mse)
    fabric_too_few = Fabric(accelerator="cpu", devices=2, strategy=too_few)
    fabric_too_few.launch()
    attempts = {
        "too_few_microbatches": lambda: fabric_too_few.setup(make_sequential()),
        "indivisible": lambda: fabric.pipeline_step(model, torch.randn(6, 8), target=torch.randn(6, 4)),
        "backward": lambda: fabric.backward(torch.ones((), requires_grad=True)),
        "forward": lambda: model(torch.randn(8, 8)),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
        except (RuntimeError, ValueError, TypeError) as err:
            raised[name] = f"{type(err).__name__}: {err}"
    # The strategy still works after refusing: a good step follows.
    x, y = regression_batches()[0]
    with torch.no_grad():  # evaluation: forward only, no gradients
        eval_loss = fabric.pipeline_step(model, x, target=y)
    no_grads = all(p.grad is None for p in model.parameters())
    loss = fabric.pipeline_step(model, x, target=y)
    reference = mse(make_sequential()(x), y)
    if fabric.global_rank == 0:  # one stage's gradient is inf: the whole model's norm is, on every rank
        next(p for p in model.parameters()).grad[0, 0] = float("inf")
    try:
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
    except RuntimeError as err:
        raised["nonfinite_clip"] = f"{type(err).__name__}: {err}"
    # Without a target, the loss function gets the output alone.
    untargeted = PipelineStrategy(split_points=["2"], microbatches=4, loss_fn=lambda out: out.pow(2).mean())
    fabric_untargeted = Fabric(accelerator="cpu", devices=2, strategy=untargeted)
    fabric_untargeted.launch()
    no_target = fabric_untargeted.pipeline_step(fabric_untargeted.setup(make_sequential()), x)
    return {
        "batches": batches, "raised": raised, "loss_after": loss, "eval_loss": eval_loss, "no_grads": no_grads,
        "reference": reference.detach(), "no_target": no_target,
        "no_target_reference": make_sequential()(x).pow(2).mean().detach(),
    }  # fmt: skip


CHECKS: dict[str, Callable[[Path], Any]] = {
    "gpipe_sequential": gpipe_sequential,
    "1f1b_gpt": one_f_one_b_gpt,
    "resume_in_another_split": resume_in_another_split,
    "interleaved_gpt": interleaved_gpt,
    "other_schedules": other_schedules,
    "bf16_mixed": bf16_mixed,
    "double_true": double_true,
    "meta_init": meta_init,
    "loader_and_bad_input": loader_and_bad_input,
}


if __name__ == "__main__":
    run_checks(CHECKS, devices=2)

"""PipelineStrategy with data_parallel_size=2 on 4 CPU ranks (2 replicas x 2 stages) against one-process training.

Usage: python pipeline_dp.py OUTDIR
Each rank writes OUTDIR/rank{N}.pt: check name -> what this rank observed (or {"error": traceback}); the 1F1B check
also saves OUTDIR/ckpt. Replica r trains on rows r*8..r*8+7 of each global batch of 16; the reference trains one
process on the whole global batch, whose mean loss is the mean of the replicas' (equal halves).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _it_common import run_checks
from pipeline_train import BATCH, SEQ, STEPS, VOCAB, make_gpt, token_loss
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric
from fabric.strategies import PipelineStrategy

DP = 2


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (STEPS, DP * BATCH, SEQ + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def pipeline_fabric(split: list[str], schedule: str, how: str = "ddp", dp: int = DP) -> Fabric:
    strategy = PipelineStrategy(
        split, schedule=schedule, microbatches=4, loss_fn=token_loss, data_parallel_size=dp, data_parallel=how
    )
    fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)
    fabric.launch()
    return fabric


def train(
    split: list[str], schedule: str, accumulate: int, how: str = "ddp", dp: int = DP
) -> tuple[Fabric, Any, Any, dict[str, Any]]:
    """Fabric's loop on this replica's share; the reference on the whole batch, stepping every `accumulate` batches."""
    fabric = pipeline_fabric(split, schedule, how, dp)
    replica = fabric.strategy.data_parallel_rank  # type: ignore[attr-defined]
    model = make_gpt()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    reference = make_gpt()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    losses, norms, unsynced = [], [], []
    for i, (x, y) in enumerate(global_batches()):
        share = DP * BATCH // dp
        rows = slice(replica * share, (replica + 1) * share)
        stepping = (i + 1) % accumulate == 0
        with fabric.no_backward_sync(model, enabled=not stepping):
            loss = fabric.pipeline_step(model, x[rows], target=y[rows])
        reference_loss = token_loss(reference(x), y)
        reference_loss.backward()
        losses.append((fabric.all_reduce(loss), reference_loss.detach()))  # the replicas' mean: the global loss
        if not stepping:  # this replica's own gradient, not yet averaged with the other's
            unsynced.append(next(p.grad.clone() for p in model.parameters() if p.grad is not None))
            continue
        norms.append((fabric.clip_gradients(model, optimizer, max_norm=0.5),
                      torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)))  # fmt: skip
        optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    return (
        fabric,
        model,
        optimizer,
        {
            "losses": losses,
            "norms": norms,
            "unsynced": unsynced,
            "weights": {k: _full(v) for k, v in model.state_dict().items()},
            "sharded": any(hasattr(v, "full_tensor") for v in model.state_dict().values()),
            "reference": {k: v.clone() for k, v in reference.state_dict().items()},
        },
    )


def one_f_one_b(outdir: Path) -> Any:
    fabric, model, optimizer, result = train(["blocks.2"], "1F1B", accumulate=1)
    fabric.save(outdir / "ckpt", {"model": model, "optimizer": optimizer})
    return result


def resume_in_four_stages(outdir: Path) -> Any:
    """The data-parallel 2-stage checkpoint into one 4-stage pipeline: another split and data-parallel size."""
    split = ["blocks.1", "blocks.2", "blocks.3"]
    fabric = Fabric(accelerator="cpu", devices=4, strategy=PipelineStrategy(split, loss_fn=token_loss))
    fabric.launch()
    model = fabric.setup(make_gpt())
    remainder = fabric.load(outdir / "ckpt", {"model": model})
    return {"weights": {k: v.clone() for k, v in model.state_dict().items()}, "remainder": sorted(remainder)}


def fsdp_1f1b(outdir: Path) -> Any:
    # Accumulating over all steps: no_backward_sync skips nothing under FSDP, and the sum must still be right.
    fabric, model, optimizer, result = train(["blocks.2"], "1F1B", accumulate=STEPS, how="fsdp")
    fabric.save(outdir / "ckpt_fsdp", {"model": model, "optimizer": optimizer})
    return result


def _full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()


def interleaved_accumulating(outdir: Path) -> Any:
    return train(["blocks.1", "blocks.2", "blocks.3"], "Interleaved1F1B", accumulate=STEPS)[3]


def gpipe(outdir: Path) -> Any:
    return train(["blocks.2"], "GPipe", accumulate=1)[3]


def four_stages_1f1b(outdir: Path) -> Any:
    """Without data parallelism: one pipeline of 4 stages over the 4 ranks, on the whole global batch."""
    return train(["blocks.1", "blocks.2", "blocks.3"], "1F1B", accumulate=1, dp=1)[3]


def loader(outdir: Path) -> Any:
    fabric = pipeline_fabric(["blocks.2"], "GPipe")
    data = TensorDataset(torch.arange(4 * BATCH))
    return {"batches": [x for (x,) in fabric.setup_dataloaders(DataLoader(data, batch_size=BATCH))]}


CHECKS: dict[str, Callable[[Path], Any]] = {
    "1f1b": one_f_one_b,
    "resume_in_four_stages": resume_in_four_stages,
    "fsdp_1f1b": fsdp_1f1b,
    "interleaved_accumulating": interleaved_accumulating,
    "gpipe": gpipe,
    "four_stages_1f1b": four_stages_1f1b,
    "loader": loader,
}


if __name__ == "__main__":
    run_checks(CHECKS, devices=4)

"""Uneven all_gather and exact evaluation (even_batches=False) on 2 CPU ranks (`strategy="ddp"`).

Usage: python uneven_eval.py OUTDIR
Each rank writes OUTDIR/rank{N}.pt: a dict from check name to what this rank observed (or {"error": traceback}).
The test process asserts on them.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch
from _it_common import outdir_from_argv
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric

SEED = 11
SIZES = (1001, 7, 1)


def gather_uneven_rows(fabric: Fabric) -> Any:
    rank = fabric.global_rank
    rows = torch.arange(6.0).view(3, 2)[: 3 * (1 - rank)] + 100 * rank  # rank 0: 3 rows, rank 1: 0 rows
    data = {"rows": rows, "inner": [torch.full((rank + 1, 2, rank + 1), rank), 5.0 + rank]}
    return fabric.all_gather(data, uneven=True)


def gather_equal_shapes(fabric: Fabric) -> Any:
    return fabric.all_gather({"x": torch.full((2, 3), fabric.global_rank)})


def gather_uneven_sync_grads(fabric: Fabric) -> Any:
    rank = fabric.global_rank
    x = torch.ones(rank + 1, requires_grad=True)
    parts = fabric.all_gather(x, sync_grads=True, uneven=True)
    # Both ranks weigh rank j's part by (j + 1): the gradient reaching rank j sums both ranks', 2 * (j + 1).
    loss = sum((j + 1) * part.sum() for j, part in enumerate(parts))
    loss.backward()
    return {"shapes": [tuple(p.shape) for p in parts], "grad": x.grad}


def gather_mismatch(fabric: Fabric) -> Any:
    rank = fabric.global_rank
    data = [torch.zeros(2)] * (rank + 1)  # rank 0 sends one tensor, rank 1 two
    try:
        fabric.all_gather(data, uneven=True)
        error = None
    except ValueError as err:
        error = str(err)
    after = fabric.all_reduce(torch.tensor(1.0), reduce_op="sum")  # the group still works: nobody hung
    return {"error": error, "after": after}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _dataset(size: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(size)
    x, y = torch.randn(size, 4, generator=gen), torch.randint(0, 3, (size,), generator=gen)
    return TensorDataset(torch.arange(size), x, y)


def _evaluate(fabric: Fabric, model: nn.Module, size: int, even_batches: bool) -> dict[str, Any]:
    """An evaluation loop as a user writes it: accumulate locally, gather and reduce after the loop."""
    loader = fabric.setup_dataloaders(DataLoader(_dataset(size), batch_size=8, shuffle=True), even_batches=even_batches)
    ids, logits, correct, seen = [], [], torch.tensor(0), torch.tensor(0)
    with torch.no_grad():
        for batch_ids, x, y in loader:
            out = model(x)
            ids.append(batch_ids)
            logits.append(out)
            correct += (out.argmax(dim=1) == y).sum()
            seen += len(y)
    local = {"ids": torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64)}
    local["logits"] = torch.cat(logits) if logits else torch.zeros(0, 3)
    gathered = fabric.all_gather(local, uneven=True)
    totals = fabric.all_reduce({"correct": correct, "seen": seen}, reduce_op="sum")
    return {
        "batches": len(loader),
        "ids": torch.cat(list(gathered["ids"])),  # list() works for a stacked tensor and for a list alike
        "logits": torch.cat(list(gathered["logits"])),
        "correct": totals["correct"],
        "seen": totals["seen"],
    }


def exact_evaluation(fabric: Fabric) -> Any:
    fabric.seed_everything(SEED)
    model = fabric.setup(_model())
    model.eval()
    reference = _model().eval()  # the single-process value, computed on the whole dataset on every rank
    results: dict[str, Any] = {}
    for size in SIZES:
        _, x, y = _dataset(size).tensors
        with torch.no_grad():
            out = reference(x)
        results[size] = {
            "exact": _evaluate(fabric, model, size, even_batches=False),
            "padded": _evaluate(fabric, model, size, even_batches=True),
            "reference": {"logits": out, "correct": int((out.argmax(dim=1) == y).sum())},
        }
    return results


CHECKS: list[Callable[[Fabric], Any]] = [
    gather_uneven_rows,
    gather_equal_shapes,
    gather_uneven_sync_grads,
    gather_mismatch,
    exact_evaluation,
]


def main() -> None:
    outdir = outdir_from_argv()
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    fabric.launch()
    results: dict[str, Any] = {}
    for check in CHECKS:
        try:
            results[check.__name__] = check(fabric)
        except Exception:
            results[check.__name__] = {"error": traceback.format_exc()}
        fabric.barrier()
    torch.save(results, outdir / f"rank{fabric.global_rank}.pt")
    fabric.strategy.teardown()


if __name__ == "__main__":
    main()

"""A litgpt-style state ({"model", "optimizer", "train_dataloader": loader, "iter_num"}) saved and loaded.

Usage: python litgpt_state.py OUTDIR DEVICES MODE
  MODE  stateful: the default install (torchdata present); the run saves after 3 steps, a second Fabric in the
        same processes loads the checkpoint into a fresh state and takes 3 more batches
        no-torchdata: torchdata cannot be imported (as in an environment without it); the same save and load
Each rank writes OUTDIR/rank{N}.json: the sample indices of the batches before and after the save, those after the
load, iter_num after the load, whether `import fabric` imported torchdata, and the warnings of the save.
"""

from __future__ import annotations

import sys
import traceback
import warnings
from typing import Any

if sys.argv[3:4] == ["no-torchdata"]:
    # None in sys.modules makes every import of the package raise ImportError, as when it is not installed.
    sys.modules["torchdata"] = None  # type: ignore[assignment]

import torch
from _it_common import outdir_from_argv, write_json
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric

IMPORTED_TORCHDATA = any(name.split(".")[0] == "torchdata" for name in sys.modules if sys.modules[name] is not None)


def _parts(fabric: Fabric) -> tuple[Any, Any, Any]:
    fabric.seed_everything(11)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    data = TensorDataset(torch.arange(40, dtype=torch.float32).repeat(2, 1).T, torch.arange(40))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=2, shuffle=True))
    return model, optimizer, loader


def _steps(model: Any, optimizer: Any, fabric: Fabric, batches: Any, n: int) -> list[list[int]]:
    seen = []
    for _ in range(n):
        x, index = next(batches)
        fabric.backward(model(x).sum())
        optimizer.step()
        optimizer.zero_grad()
        seen.append(index.tolist())
    return seen


def main() -> None:
    outdir = outdir_from_argv()
    devices, mode = int(sys.argv[2]), sys.argv[3]
    fabric = Fabric(accelerator="cpu", strategy="ddp" if devices > 1 else "auto", devices=devices)
    fabric.launch()
    result: dict[str, Any] = {"imported_torchdata": IMPORTED_TORCHDATA}
    try:
        model, optimizer, loader = _parts(fabric)
        batches = iter(loader)
        result["before"] = _steps(model, optimizer, fabric, batches, 3)
        state = {"model": model, "optimizer": optimizer, "train_dataloader": loader, "iter_num": 3}
        path = outdir / "ckpt.pth"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fabric.save(path, state)
        result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
        result["after"] = _steps(model, optimizer, fabric, batches, 3)  # what an uninterrupted run reads next

        model, optimizer, loader = _parts(fabric)
        state = {"model": model, "optimizer": optimizer, "train_dataloader": loader, "iter_num": 0}
        # A loader saved whole (no torchdata) is a pickled object: loading it needs weights_only=False, as in torch.
        fabric.load(path, state, weights_only=False if mode == "no-torchdata" else None)
        result["iter_num"] = state["iter_num"]
        result["same_loader"] = state["train_dataloader"] is loader
        result["resumed"] = _steps(model, optimizer, fabric, iter(loader), 3)
    except Exception:
        result["error"] = traceback.format_exc()
    write_json(outdir / f"rank{fabric.global_rank}.json", result)


if __name__ == "__main__":
    main()

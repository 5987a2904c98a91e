"""TensorBoardLogger and CSVLogger on 2 ranks, called on every rank as Lightning Fabric scripts do.

Usage: python rank_zero_loggers.py OUTDIR
Both loggers write under OUTDIR/logs. Every rank calls fabric.log, fabric.log_dict, each logger's log_metrics,
log_hyperparams, experiment (add_scalar; on rank 1 also experiment[0].add_text and item assignment), save and
finalize. Each rank
writes OUTDIR/rank{N}.json: the experiment classes, what the calls returned, and the files under OUTDIR/logs it saw
after its own calls and before rank 0 started writing (a barrier orders them).
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

from _it_common import outdir_from_argv, write_json

from fabric import Fabric
from fabric.loggers import CSVLogger, TensorBoardLogger


def _files(root: str) -> list[str]:
    base = Path(root)
    return sorted(str(path.relative_to(base)) for path in base.rglob("*") if path.is_file())


def _use(fabric: Fabric, tb: TensorBoardLogger, csv: CSVLogger) -> dict[str, Any]:
    returned = [
        fabric.log("loss", 1.0 + fabric.global_rank, step=0),
        fabric.log_dict({"acc": 0.5}, step=1),
        tb.log_metrics({"direct": 2.0}, step=2),
        tb.log_hyperparams({"lr": 0.1}),
        csv.log_metrics({"direct": 2.0}, step=2),
        csv.log_hyperparams({"lr": 0.1}),
        tb.experiment.add_scalar("writer", 3.0, 3),
        csv.experiment.log_metrics({"via_experiment": 4.0}, 4),
        tb.save(),
        csv.save(),
    ]
    if fabric.global_rank:  # what Lightning's dummy allows for loggers whose experiment is a list or a dict
        returned.append(tb.experiment[0].add_text("note", "hello"))
        tb.experiment["key"] = "value"
    return {
        "tb_experiment": type(tb.experiment).__name__,
        "csv_experiment": type(csv.experiment).__name__,
        "returned": [repr(value) for value in returned],
    }


def main() -> None:
    outdir = outdir_from_argv()
    root = str(outdir / "logs")
    tb, csv = TensorBoardLogger(root, name="tb"), CSVLogger(root, name="csv")
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2, loggers=[tb, csv])
    fabric.launch()
    result: dict[str, Any] = {}
    try:
        if fabric.global_rank == 1:  # rank 1 first, while nothing exists yet: whatever appears is its own
            result.update(_use(fabric, tb, csv))
            tb.finalize("success")
            csv.finalize("success")
            result["files_after_own_calls"] = _files(root)
        fabric.barrier()
        if fabric.global_rank == 0:
            result.update(_use(fabric, tb, csv))
            tb.finalize("success")
            csv.finalize("success")
            result["files_after_own_calls"] = _files(root)
    except Exception:
        result["error"] = traceback.format_exc()
    write_json(outdir / f"rank{fabric.global_rank}.json", result)


if __name__ == "__main__":
    main()

"""Two CPU ranks run SpikeDetection; only rank 1's loss spikes (at batch 5), yet both ranks stop there.

Then both call Lightning's private reduce/gather helpers.

Usage: python spike_ranks.py OUTDIR   (starts the second rank itself through fabric's ddp launcher)
"""

import json
import sys
from pathlib import Path

import torch

from fabric import Fabric
from fabric.utilities.distributed import _all_gather_ddp_if_available, _sync_ddp_if_available
from fabric.utilities.spike import SpikeDetection, TrainingSpikeException


def main(out: Path) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    detector = SpikeDetection(exclude_batches_path=out / "skip")
    stopped_at = None
    for batch_idx in range(10):
        spike = fabric.global_rank == 1 and batch_idx == 5
        loss = torch.tensor(100.0 if spike else 1.0 - 0.01 * batch_idx)
        try:
            detector.on_train_batch_end(fabric, loss, None, batch_idx)
        except TrainingSpikeException as err:
            stopped_at = (batch_idx, str(err))
            break
    mine = torch.tensor([fabric.global_rank + 1.0])
    report = {
        "stopped_at": stopped_at,
        "bad_batches": detector.bad_batches,
        # Lightning's private helpers, which client code calls directly
        "sum": _sync_ddp_if_available(mine).item(),
        "mean": _sync_ddp_if_available(mine, reduce_op="mean").item(),
        "gathered": _all_gather_ddp_if_available(mine).flatten().tolist(),
    }
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(report))
    fabric.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

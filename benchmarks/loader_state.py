"""What saving a loader's position adds to fabric.save: the state capture alone, and a whole save with and without it.

A small training state (Linear(256, 256) + SGD with momentum, ~0.5 MB file) and a shuffled loader over 20000
samples (batch 32) stopped after 10 batches of its epoch. Per case (one process / 2 ranks over gloo, 0 / 2 loader
workers) a fresh process (or pair of ranks) measures, --reps times each, alternating:
  capture          what fabric.save does for the loader entry: its state (epoch, position, torchdata's state) and,
                   on 2 ranks, the one all_gather that puts every rank's state in the checkpoint
  + serialize      the capture and pickling the entry: all the work the loader adds to a save
  one barrier      fabric.barrier() alone: what one collective round trip costs on this machine, for scale
  save without     fabric.save(path, {'model', 'optimizer', 'step'})   (temporary file, fsync, rename)
  save with        the same plus {'loader': loader}
Target: saving loader state adds under 1 ms to fabric.save, judged on the median of capture + serialize (the paired
difference of the two saves is shown too, but an fsync'ed save varies by more than 1 ms on a shared disk).

Run:  python benchmarks/loader_state.py [--reps 200]
      python benchmarks/loader_state.py --smoke     # 20 reps, one process only (both cases in it): does it run?
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import Row, contenders, emit, median_iqr, p10, print_table, run_json

TARGET_MS = 1.0


def worker(devices: int, workers: list[int], folder: str, reps: int) -> None:
    """One process (or rank): a case per count of loader workers, in turn; rank 0 prints each case's times."""
    rank = 0
    results: dict[str, dict[str, list[float]]] = {}  # by count of loader workers
    for count in workers:
        rank, results[str(count)] = _case(devices, count, folder, reps)
    if rank == 0:
        emit(results)


def _case(devices: int, workers: int, folder: str, reps: int) -> tuple[int, dict[str, list[float]]]:
    """Set up, train 10 batches, then time the captures and saves `reps` times; this rank and its times."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from fabric import Fabric
    from fabric.utilities._loader_state import collect

    fabric = Fabric(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto")
    fabric.launch()
    torch.set_num_threads(1)
    fabric.seed_everything(0, verbose=False)
    model = nn.Linear(256, 256)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    data = TensorDataset(torch.randn(20000, 256))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=32, shuffle=True, num_workers=workers))
    iterator = iter(loader)
    for _ in range(10):
        (x,) = next(iterator)
        fabric.backward(model(x).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    base = {"model": model, "optimizer": optimizer, "step": 10}
    times: dict[str, list[float]] = {"capture": [], "serialize": [], "barrier": [], "without": [], "with": []}
    target = Path(folder) / f"ckpt_{devices}_{workers}"
    for rep in range(reps):
        fabric.barrier()
        start = time.perf_counter()
        entry = collect(loader)
        times["capture"].append(time.perf_counter() - start)
        pickle.dumps(entry)  # what torch.save adds for the entry inside the checkpoint (no zip container of its own)
        times["serialize"].append(time.perf_counter() - start)
        fabric.barrier()
        start = time.perf_counter()
        fabric.barrier()
        times["barrier"].append(time.perf_counter() - start)
        order = [("without", base), ("with", {**base, "loader": loader})]
        for name, state in order if rep % 2 == 0 else order[::-1]:
            fabric.barrier()
            start = time.perf_counter()
            fabric.save(target, state)
            times[name].append(time.perf_counter() - start)
    fabric.barrier()
    fabric.strategy.teardown()
    return fabric.global_rank, times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=200, help="saves of each kind per process")
    parser.add_argument("--dir", help="where the checkpoints go (default: the system temporary directory)")
    parser.add_argument("--peer-python", help=argparse.SUPPRESS)  # run_all passes it; no peer saves loaders
    parser.add_argument("--smoke", action="store_true", help="20 reps, one process only")
    parser.add_argument("--worker", nargs=4, metavar=("DEVICES", "WORKERS", "DIR", "REPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        devices, workers, folder, reps = args.worker
        worker(int(devices), [int(count) for count in workers.split(",")], folder, int(reps))
        return 0
    # A fresh process (or pair of ranks) per case; --smoke runs its cases in one process, to stay quick.
    cases = [(1, [0, 2])] if args.smoke else [(1, [0]), (1, [2]), (2, [0]), (2, [2])]
    reps = 20 if args.smoke else args.reps
    contenders("fabric.save without loader", None)  # prints the machine line
    tmp = Path(tempfile.mkdtemp(prefix="fabric-loader-bench-", dir=args.dir))
    verdicts = []
    try:
        for devices, workers in cases:
            env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK")}
            counts = ",".join(map(str, workers))
            data, _ = run_json(sys.executable, [__file__, "--worker", str(devices), counts, str(tmp), str(reps)],
                               env=env)  # fmt: skip
            verdicts += [_report(devices, count, data[str(count)], reps) for count in workers]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if all(verdicts) else 1


def _report(devices: int, workers: int, times: dict[str, Any], reps: int) -> bool:
    case = f"{devices} process{'es' if devices > 1 else ''}, num_workers={workers}"
    print_table(f"Loader state, {case}: {reps} reps, rank 0's times", [
        Row("fabric.save without loader", times["without"]),
        Row("fabric.save with loader", times["with"], times["without"], "model + optimizer + loader"),
        Row("loader state capture", times["capture"], None, "state_dict (+ gather on 2 ranks)"),
        Row("capture + serialize", times["serialize"], None, "and pickling the entry"),
        Row("one barrier (for scale)", times["barrier"], None, "a collective round trip, nothing else"),
    ], "ms", 1e3)  # fmt: skip
    capture = median_iqr(times["serialize"])[0] * 1e3
    # Paired: each rep's two saves ran back to back, so their difference cancels most of the disk's drift.
    added = median_iqr([w - wo for w, wo in zip(times["with"], times["without"], strict=True)])[0] * 1e3
    verdict = capture < TARGET_MS
    print(
        f"target: loader state adds < {TARGET_MS:.0f} ms to fabric.save ({case}) -> capture + serialize median "
        f"{capture:.3f} ms "
        f"(p10 {p10(times['serialize']) * 1e3:.3f} ms), paired save with - without median {added:+.3f} ms: "
        f"{'PASS' if verdict else 'FAIL'} (judged on the capture + serialize median)"
    )
    return verdict


if __name__ == "__main__":
    sys.exit(main())

"""Asynchronous saves: how long `fabric.save` blocks the loop with AsyncCheckpointIO, against a synchronous save.

The state is a model of about --size-mb MB of float32 parameters (square Linear layers) with AdamW, so the
checkpoint holds about 3x that (weights, exp_avg, exp_avg_sq). Each worker is a fresh process that does what a
training script does: fabric.setup, --steps training steps, the first save, then --saves - 1 more saves with a
training step before each (so the weights change, as in a real loop); it times each save. Contenders:
  torch.save + fsync   torch.save({'model': sd, 'optimizer': sd, 'step': i}, f), flush, os.fsync (the durable baseline)
  fabric sync          fabric.save with the default TorchCheckpointIO (temporary file, fsync, rename)
  fabric async         fabric.save with AsyncCheckpointIO: the time the call blocks; "written" is the time until
                       fabric.barrier() returns, i.e. until the background write is on disk
The two synchronous contenders run in the same process, alternating (which goes first alternates too): how long
an fsync takes depends on what else the machine writes, and pairing them cancels most of that. Workers keep torch's
default number of threads, as a training process would: the async snapshot copies with up to that many threads.
The first async save of a process needs CPU copy buffers (fresh pages, which the kernel must fault in); fabric
reserves them in a background thread after the first optimizer step (AsyncCheckpointIO.reserve), and a save that
comes before that thread has finished waits for it. Later saves refill the same buffers. "First" and "later" async
saves are reported apart, each as a ratio to the synchronous
fabric.save of the same round (per-round ratios: median and p25-p75 band). Targets: (a) the first async save
blocks at most 0.25x a synchronous fabric.save; (b) later saves at most 0.10x; (c) a synchronous fabric.save within
1.10x of torch.save + fsync. Lightning Fabric has no asynchronous CheckpointIO, so no peer is measured. --rounds
interleaved rounds (round_order), a fresh process per mode (sync, async) and round (--smoke: both modes in one), all
writing into one temporary directory (--dir). The default state gives a checkpoint of about 128 MiB.

Run:  python benchmarks/checkpoint_async.py [--rounds 9] [--size-mb 42.7] [--steps 10] [--saves 3] [--dir /tmp]
      python benchmarks/checkpoint_async.py --smoke     # 1 round, 16 MB, 2 saves, one process: does it run?
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import MIN_ROUNDS, Row, contenders, emit, load_line, print_ratio, print_table, round_order, run_json

WIDTH = 1024  # one Linear(WIDTH, WIDTH) holds 4.2 MB of float32 weights and bias
TARGET_FIRST = 0.25
TARGET_BLOCKING = 0.10
TARGET_SYNC = 1.10
MODES = ("sync", "async")  # "sync" times torch.save + fsync and fabric's synchronous save alternately


def _state(size_mb: float) -> tuple[Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    per_layer = (WIDTH * WIDTH + WIDTH) * 4 / 2**20
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(max(1, round(size_mb / per_layer)))))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _step(model: Any, optimizer: Any) -> None:
    import torch

    model(torch.randn(4, WIDTH)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _raw_save(model: Any, optimizer: Any, path: Path, step: int) -> None:
    import torch

    with path.open("wb") as handle:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, handle)
        handle.flush()
        os.fsync(handle.fileno())


def worker(modes: list[str], folder: str, size_mb: float, steps: int, saves: int) -> None:
    """Fresh process: each of `modes` in turn (see `_save_times`); print the timings per mode as JSON."""
    emit({mode: _save_times(mode, folder, size_mb, steps, saves) for mode in modes})


def _save_times(mode: str, folder: str, size_mb: float, steps: int, saves: int) -> dict[str, Any]:
    """Build the state, take `steps` steps, save it `saves` times (a step before each later one); the timings."""
    from fabric import AsyncCheckpointIO, Fabric

    model, optimizer = _state(size_mb)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[AsyncCheckpointIO()] if mode == "async" else None)
    model, optimizer = fabric.setup(model, optimizer)
    times: dict[str, list[float]] = {"raw": [], "blocked": [], "written": []}
    path = Path(folder) / f"{mode}.pt"
    for _ in range(steps - 1):
        _step(model, optimizer)
    for i in range(saves):
        _step(model, optimizer)
        if mode == "sync" and i % 2 == 0:
            start = time.perf_counter()
            _raw_save(model, optimizer, Path(folder) / "raw.pt", i)
            times["raw"].append(time.perf_counter() - start)
        start = time.perf_counter()
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": i})
        times["blocked"].append(time.perf_counter() - start)
        fabric.barrier()  # waits for the background write (nothing to wait for after a synchronous save)
        times["written"].append(time.perf_counter() - start)
        if mode == "sync" and i % 2 == 1:
            start = time.perf_counter()
            _raw_save(model, optimizer, Path(folder) / "raw.pt", i)
            times["raw"].append(time.perf_counter() - start)
    n_params = sum(p.numel() for p in model.parameters())
    return {**times, "param_mb": n_params * 4 / 2**20, "file_mb": path.stat().st_size / 2**20}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS, help="interleaved rounds (a fresh process each)")
    parser.add_argument("--size-mb", type=float, default=128 / 3, help="float32 parameter MB (checkpoint ~3x)")
    parser.add_argument("--steps", type=int, default=10, help="training steps before the first save (>= 1)")
    parser.add_argument("--saves", type=int, default=3, help="saves per process (the first async one is cold)")
    parser.add_argument("--dir", help="where the checkpoints go (default: the system temporary directory)")
    parser.add_argument("--peer-python", help=argparse.SUPPRESS)  # run_all passes it; no peer has async saves
    parser.add_argument("--smoke", action="store_true", help="1 round, 16 MB, 2 steps, 2 saves, one process")
    parser.add_argument("--worker", nargs=5, metavar=("MODES", "DIR", "MB", "STEPS", "SAVES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        modes, folder, size, steps, saves = args.worker
        worker(modes.split(","), folder, float(size), int(steps), int(saves))
        return 0
    if args.smoke:
        args.rounds, args.size_mb, args.steps, args.saves = 1, 16, 2, 2
    args.steps = max(1, args.steps)
    contenders("torch.save + fsync", None)  # prints the machine line
    print(load_line())
    tmp = Path(tempfile.mkdtemp(prefix="fabric-async-bench-", dir=args.dir))
    samples: dict[str, list[float]] = {key: [] for key in ("raw", "sync", "async_first", "async_later", "written")}
    # One value per round and contender (medians of its process), paired for the ratio bands.
    rounds: dict[str, list[float]] = {key: [] for key in ("raw", "sync", "async_first", "async_later")}
    sizes: tuple[float, float] = (0.0, 0.0)
    try:
        for r in range(args.rounds):
            # A fresh process per mode; --smoke runs both modes in one, to stay quick.
            order = round_order(MODES, r)
            for group in [order] if args.smoke else [[mode] for mode in order]:
                cmd = [__file__, "--worker", ",".join(group), str(tmp), str(args.size_mb), str(args.steps)]
                results, _ = run_json(sys.executable, [*cmd, str(args.saves)])
                for mode in group:
                    _collect(mode, results[mode], samples, rounds)
                sizes = (results[group[-1]]["param_mb"], results[group[-1]]["file_mb"])
        _report(samples, rounds, sizes, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _collect(mode: str, data: dict[str, Any], samples: dict[str, list[float]], rounds: dict[str, list[float]]) -> None:
    """Add one process's timings of `mode` to the samples and to the per-round values (medians of the process)."""
    if mode == "async":
        samples["async_first"].append(data["blocked"][0])
        samples["async_later"] += data["blocked"][1:]
        samples["written"] += data["written"][1:]
        rounds["async_first"].append(data["blocked"][0])
        rounds["async_later"].append(statistics.median(data["blocked"][1:]))
    else:
        samples["raw"] += data["raw"]
        samples["sync"] += data["blocked"]
        rounds["raw"].append(statistics.median(data["raw"]))
        rounds["sync"].append(statistics.median(data["blocked"]))


def _report(
    samples: dict[str, list[float]],
    rounds: dict[str, list[float]],
    sizes: tuple[float, float],
    args: argparse.Namespace,
) -> None:
    print(f"\nstate: {sizes[0]:.0f} MB float32 parameters + AdamW state; checkpoint file {sizes[1]:.0f} MB")
    how = "one process for both modes (--smoke)" if args.smoke else "a fresh process each"
    runs = f"{args.rounds} rounds x {args.saves} saves (the first after {args.steps} steps), {how}"
    print_table(f"Synchronous save: time, {runs} (the two alternate in one process)", [
        Row("torch.save + fsync", samples["raw"]),
        Row("fabric sync", samples["sync"], samples["raw"], "temporary file, fsync, rename"),
    ], "ms", 1e3)  # fmt: skip
    print_table(f"Time fabric.save blocks the loop, {runs}", [
        Row("fabric sync", samples["sync"]),
        Row("fabric async, first save", samples["async_first"], samples["sync"], "copies into reserved buffers"),
        Row("fabric async, later saves", samples["async_later"], samples["sync"], "refills the CPU copy"),
        Row("fabric async, until written", samples["written"], samples["sync"], "save + barrier()"),
    ], "ms", 1e3)  # fmt: skip
    print_ratio("async first save blocking / sync fabric.save", rounds["async_first"], rounds["sync"], TARGET_FIRST)
    print_ratio("async later saves blocking / sync fabric.save", rounds["async_later"], rounds["sync"], TARGET_BLOCKING)
    print_ratio("sync fabric.save / torch.save + fsync", rounds["sync"], rounds["raw"], TARGET_SYNC)


if __name__ == "__main__":
    sys.exit(main())

"""What a loader from setup_dataloaders costs per batch and per epoch start: raw DataLoader, fabric, Lightning Fabric.

One process (one CPU thread), a shuffled DataLoader over a TensorDataset (batch 32), with torchdata installed (fabric
then rebuilds the loader as a StatefulDataLoader whose position can be saved). Each round runs every contender once,
in `round_order` (rotated, reversed every other round), and the per-round ratio to the raw loader gives the band:
  per batch     num_workers=0: one epoch (--batches batches), time per batch
  epoch start   num_workers=2: iter(loader) to the first batch (workers forked and started), and the whole short
                epoch (--batches-mp batches) including the workers' shutdown; `fabric freeze_gc` is
                setup_dataloaders(..., freeze_gc=True) with a parent heap of --heap-objects Python objects, which forked
                workers would otherwise copy when they collect garbage; and a last table with workers whose
                worker_init_fn runs gc.collect(): raw vs fabric vs fabric freeze_gc (the stall freeze_gc removes)
Targets (issue 21): per batch <= 1.01x raw; epoch start <= raw + 0.5 ms (median of the per-round differences).

Run:  python benchmarks/loader_overhead.py [--rounds 9]
      python benchmarks/loader_overhead.py --smoke     # 2 rounds, small epochs: does it run?
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

from _common import MIN_ROUNDS, Row, contenders, load_line, print_ratio, print_table, round_order

BATCH = 32
PER_BATCH_TARGET = 1.01
EPOCH_START_TARGET_MS = 0.5


def _collect_garbage(worker_id: int) -> None:
    """A worker_init_fn: a full collection as soon as the worker starts, as a worker's own allocations may trigger."""
    import gc

    gc.collect()


def _loaders(samples: int, workers: int, with_freeze: bool, init_fn: Any = None, peer: bool = True) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from fabric import Fabric

    dataset = TensorDataset(torch.randn(samples, 16))

    def plain() -> DataLoader:
        return DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=workers, worker_init_fn=init_fn)

    fabric = Fabric(accelerator="cpu", devices=1)
    loaders: dict[str, Any] = {"raw DataLoader": plain(), "fabric": fabric.setup_dataloaders(plain())}
    if with_freeze:
        loaders["fabric freeze_gc"] = fabric.setup_dataloaders(plain(), freeze_gc=True)
    try:
        if not peer:
            return loaders
        from lightning_fabric import Fabric as LightningFabric
    except ImportError:
        print("skipped: lightning_fabric: not importable here")
    else:
        loaders["lightning_fabric"] = LightningFabric(accelerator="cpu", devices=1).setup_dataloaders(plain())
    return loaders


def _per_batch(loader: Any) -> float:
    start = time.perf_counter()
    count = 0
    for _ in loader:
        count += 1
    return (time.perf_counter() - start) / count


def _epoch_start(loader: Any) -> tuple[float, float]:
    start = time.perf_counter()
    iterator = iter(loader)
    next(iterator)
    first = time.perf_counter() - start
    for _ in iterator:
        pass
    return first, time.perf_counter() - start


def _rounds(names: list[str], rounds: int, measure: Callable[[str], Any]) -> dict[str, list[Any]]:
    samples: dict[str, list[Any]] = {name: [] for name in names}
    for index in range(rounds):
        for name in round_order(names, index):
            samples[name].append(measure(name))
    return samples


def _difference(samples: list[float], baseline: list[float]) -> float:
    return statistics.median(s - b for s, b in zip(samples, baseline, strict=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS, help=f"interleaved rounds (at least {MIN_ROUNDS})")
    parser.add_argument("--batches", type=int, default=400, help="batches per epoch, num_workers=0")
    parser.add_argument("--batches-mp", type=int, default=8, help="batches per epoch, num_workers=2")
    parser.add_argument("--heap-objects", type=int, default=300_000, help="Python objects the parent holds")
    parser.add_argument("--peer-python", help=argparse.SUPPRESS)  # run_all passes it; the peer runs in-process here
    parser.add_argument("--smoke", action="store_true", help="2 rounds, small epochs")
    args = parser.parse_args()
    rounds = 2 if args.smoke else max(args.rounds, MIN_ROUNDS)
    if args.smoke:
        args.batches, args.heap_objects = 20, 1000
    contenders("raw DataLoader", None)  # prints the machine line
    print(load_line())
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 on a newer torch

    loaders = _loaders(args.batches * BATCH, 0, with_freeze=False)
    names = list(loaders)
    for loader in loaders.values():
        _per_batch(loader)  # warm-up: imports, first allocations
    per_batch = _rounds(names, rounds, lambda name: _per_batch(loaders[name]))
    raw = per_batch["raw DataLoader"]
    title = f"Per batch, num_workers=0, batch {BATCH}: {rounds} rounds of {args.batches} batches"
    print_table(title, [Row(name, per_batch[name], None if name == names[0] else raw) for name in names], "us", 1e6)
    ok = print_ratio("fabric / raw per batch", per_batch["fabric"], raw, PER_BATCH_TARGET)
    for name in names[1:]:
        print(f"{name}: {_difference(per_batch[name], raw) * 1e6:+.2f} us per batch (median of per-round differences)")

    heap = [{"i": i} for i in range(args.heap_objects)]  # a training script's Python heap, for the forked workers
    loaders = _loaders(args.batches_mp * BATCH, 2, with_freeze=True)
    names = list(loaders)
    starts = _rounds(names, rounds, lambda name: _epoch_start(loaders[name]))
    first = {name: [s[0] for s in starts[name]] for name in names}
    whole = {name: [s[1] for s in starts[name]] for name in names}
    raw_first, raw_whole = first["raw DataLoader"], whole["raw DataLoader"]
    case = f"num_workers=2, {rounds} rounds, parent heap {len(heap)} objects"
    print_table(f"Epoch start (iter to first batch), {case}", [
        Row(name, first[name], None if name == names[0] else raw_first) for name in names
    ], "ms", 1e3)  # fmt: skip
    print_table(f"Whole epoch of {args.batches_mp} batches, {case}", [
        Row(name, whole[name], None if name == names[0] else raw_whole) for name in names
    ], "ms", 1e3)  # fmt: skip
    print_ratio("fabric / raw epoch start", first["fabric"], raw_first)
    added = _difference(first["fabric"], raw_first) * 1e3
    verdict = added <= EPOCH_START_TARGET_MS
    for name in names[1:]:
        start_ms = _difference(first[name], raw_first) * 1e3
        epoch_ms = _difference(whole[name], raw_whole) * 1e3
        print(f"{name}: {start_ms:+.2f} ms per epoch start, {epoch_ms:+.2f} ms per epoch (per-round medians)")
    _gc_stall(rounds, args.batches_mp, len(heap))
    print(
        f"target: fabric epoch start <= raw + {EPOCH_START_TARGET_MS} ms -> {added:+.2f} ms: "
        f"{'PASS' if verdict else 'FAIL'} (median of per-round differences)"
    )
    return 0 if (ok and verdict) or args.smoke else 1


def _gc_stall(rounds: int, batches: int, heap: int) -> None:
    """The stall freeze_gc removes: workers whose first act is a full collection copy the parent's heap."""
    loaders = _loaders(batches * BATCH, 2, with_freeze=True, init_fn=_collect_garbage, peer=False)
    names = list(loaders)
    first = {name: [s[0] for s in samples] for name, samples in _rounds(
        names, rounds, lambda name: _epoch_start(loaders[name])
    ).items()}  # fmt: skip
    raw = first["raw DataLoader"]
    title = f"Epoch start, workers that collect garbage first (worker_init_fn=gc.collect), parent heap {heap} objects"
    print_table(title, [Row(name, first[name], None if name == names[0] else raw) for name in names], "ms", 1e3)
    print_ratio("fabric freeze_gc / raw epoch start, collecting workers", first["fabric freeze_gc"], raw)


if __name__ == "__main__":
    sys.exit(main())

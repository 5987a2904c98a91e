"""fork() after an asynchronous save: does holding the snapshot buffers make every later fork() slower?

A background save keeps its CPU copy of the state between saves, so that later saves only copy. DataLoader
workers fork the training process at each epoch start; a fork copies the page tables of all memory the process
holds, so 1 GiB of held buffers would cost about 200 ms per fork. fabric maps them with MADV_DONTFORK (Linux).
Each round is a fresh process that holds a state of --held-mb MB of float32 tensors (the "model", touched, as
trained weights are) and a Fabric with AsyncCheckpointIO, and times --forks fork() calls (the parent's time in
os.fork(); the child exits at once) twice:
  before   the state only, nothing saved yet
  after    the same process after fabric.save has run and been written (the snapshot buffers held)
The ratio is after / before per round (median of each process's forks); the pairing inside one process cancels
what differs between processes. Lightning Fabric has no asynchronous CheckpointIO, so no peer is measured.
Target: after <= 1.20x before.

Run:  python benchmarks/fork_after_async.py [--rounds 9] [--held-mb 1024] [--forks 5]
      python benchmarks/fork_after_async.py --smoke     # 1 round, 32 MB, 3 forks: does it run?
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

from _common import MIN_ROUNDS, Row, contenders, emit, load_line, print_ratio, print_table, run_json

TARGET = 1.20


def _time_forks(count: int) -> list[float]:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        times.append(time.perf_counter() - start)
        os.waitpid(pid, 0)
    return times


def worker(folder: str, held_mb: float, forks: int) -> None:
    """Fresh process: hold the state, time fork(), save it in the background, time fork() again."""
    import torch

    from fabric import AsyncCheckpointIO, Fabric

    state = {f"w{i}": torch.ones(16 << 18) for i in range(max(1, round(held_mb / 16)))}  # 16 MB tensors
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[AsyncCheckpointIO()])
    before = _time_forks(forks)
    fabric.save(Path(folder) / "ckpt.pt", state)
    fabric.barrier()  # the write is done; the buffers stay for the next save
    after = _time_forks(forks)
    emit({"before": before, "after": after, "held_mb": sum(t.nbytes for t in state.values()) / 2**20})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS, help="interleaved rounds, a fresh process each")
    parser.add_argument("--held-mb", type=float, default=1024, help="MB of state held (and snapshotted)")
    parser.add_argument("--forks", type=int, default=5, help="fork() calls timed per process")
    parser.add_argument("--dir", help="where the checkpoint goes (default: the system temporary directory)")
    parser.add_argument("--peer-python", help=argparse.SUPPRESS)  # run_all passes it; no peer has async saves
    parser.add_argument("--smoke", action="store_true", help="1 round, 32 MB, 3 forks")
    parser.add_argument("--worker", nargs=3, metavar=("DIR", "MB", "FORKS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        folder, held, forks = args.worker
        worker(folder, float(held), int(forks))
        return 0
    if args.smoke:
        args.rounds, args.held_mb, args.forks = 1, 32, 3
    contenders("fork() before the save", None)  # prints the machine line
    print(load_line())
    tmp = Path(tempfile.mkdtemp(prefix="fabric-fork-bench-", dir=args.dir))
    samples: dict[str, list[float]] = {"before": [], "after": []}
    held = 0.0
    try:
        for _ in range(args.rounds):
            data, _ = run_json(sys.executable, [__file__, "--worker", str(tmp), str(args.held_mb), str(args.forks)])
            for key in samples:
                samples[key].append(statistics.median(data[key]))
            held = data["held_mb"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    title = f"fork() time, {held:.0f} MB of state held, {args.rounds} rounds (median of {args.forks} forks each)"
    print_table(title, [
        Row("fabric, before the save", samples["before"], note="the state only"),
        Row("fabric, after an async save", samples["after"], samples["before"], "snapshot buffers held"),
    ], "ms", 1e3)  # fmt: skip
    print_ratio("fork() after an async save / before", samples["after"], samples["before"], TARGET)
    return 0


if __name__ == "__main__":
    sys.exit(main())

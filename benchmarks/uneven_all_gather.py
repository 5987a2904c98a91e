"""all_gather of about 1 MB per rank on 2 CPU processes over gloo: uneven shapes against equal shapes.

Contenders, all in the same pair of processes, alternating call by call so that drift hits them alike:
- raw equal: `torch.distributed.all_gather_single` (all_gather_into_tensor) of a (1024, 256) float32 tensor
  (1 MiB) on both ranks, into a preallocated (2, 1024, 256) tensor;
- strategy equal: `fabric.strategy.all_gather`, fabric's per-tensor gather (what the default
  `fabric.all_gather(data)` issues; benchmarks/collectives.py compares that with raw torch);
- fabric equal: `fabric.all_gather(data, uneven=True)` of the same tensors (stacked; one small shape exchange on
  top: what the opt-in costs when the shapes turn out equal);
- fabric uneven: `fabric.all_gather(data, uneven=True)` with rank 0 sending (1024, 256) and rank 1 (1000, 256),
  the shape a last batch has (shape exchange, padding to the largest, one gather, slicing back into a list).
Rank 0 times each call (a barrier before each keeps the ranks in step); every round starts a fresh pair of
processes. The target: uneven <= 1.2x equal (both through fabric).

Run:  python benchmarks/uneven_all_gather.py [--rounds 5] [--smoke]
"""

from __future__ import annotations

import argparse
import sys
import time

from _common import HERE, Row, check_target, emit, machine_line, print_table, probe, run_two_ranks

WORLD_SIZE = 2
ROWS, WIDTH, SHORT_ROWS = 1024, 256, 1000
TARGET = 1.2
CONTENDERS = ("raw equal", "strategy equal", "fabric equal", "fabric uneven")


def worker(calls: int, scale: int) -> None:
    """One rank: time `calls` gathers of each contender, interleaved; rank 0 prints the times."""
    import torch
    import torch.distributed as dist

    from fabric import Fabric

    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=WORLD_SIZE)
    fabric.launch()
    rank = fabric.global_rank
    rows = ROWS // scale
    equal = torch.randn(rows, WIDTH // scale)
    uneven = equal if rank == 0 else equal[: SHORT_ROWS // scale].clone()

    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def raw_equal() -> None:
        out = equal.new_empty(WORLD_SIZE * equal.numel())
        gather_single(out, equal.reshape(-1))
        out.view(WORLD_SIZE, *equal.shape)  # what fabric returns for equal shapes, so both produce the same result

    run = {
        "raw equal": raw_equal,
        "strategy equal": lambda: fabric.strategy.all_gather(equal),
        "fabric equal": lambda: fabric.all_gather(equal, uneven=True),
        "fabric uneven": lambda: fabric.all_gather(uneven, uneven=True),
    }
    check = fabric.all_gather(uneven, uneven=True)
    assert isinstance(check, list) and check[1].shape[0] == SHORT_ROWS // scale, "the uneven path was not taken"
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for i in range(calls + 10):  # 10 warm-up calls of each
        k = i % len(CONTENDERS)
        for name in CONTENDERS[k:] + CONTENDERS[:k]:
            dist.barrier()
            start = time.perf_counter()
            run[name]()
            if i >= 10:
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        emit({"times": times, "bytes_per_rank": equal.numel() * equal.element_size()})
    fabric.strategy.teardown()


def launch(calls: int, scale: int) -> dict:
    """Start both ranks as torchrun would; return rank 0's JSON."""
    return run_two_ranks([str(HERE / "uneven_all_gather.py"), "--worker", str(calls), str(scale)], {}, timeout=300)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="fresh process pairs, one after another")
    parser.add_argument("--calls", type=int, default=200, help="timed calls per contender and round")
    parser.add_argument("--smoke", action="store_true", help="one round of a few small calls (checks it runs)")
    parser.add_argument("--peer-python", help="accepted for run_all; there is no peer to compare with here")
    parser.add_argument("--worker", nargs=2, type=int, metavar=("CALLS", "SCALE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    rounds, calls, scale = (1, 5, 16) if args.smoke else (args.rounds, args.calls, 1)
    print(machine_line({"current": probe(sys.executable)}))
    samples: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    size = 0
    for _ in range(rounds):
        data = launch(calls, scale)
        size = data["bytes_per_rank"]
        for name in CONTENDERS:
            samples[name] += data["times"][name]
    rows = [
        Row("raw equal", samples["raw equal"]),
        Row("strategy equal", samples["strategy equal"], samples["raw equal"], "baseline: raw equal"),
        Row("fabric equal", samples["fabric equal"], samples["raw equal"], "baseline: raw equal"),
        Row("fabric uneven", samples["fabric uneven"], samples["fabric equal"], "baseline: fabric equal"),
    ]
    title = (
        f"all_gather, {WORLD_SIZE} CPU processes (gloo), {size / 2**20:.2f} MiB per rank (uneven: rank 1 sends "
        f"{SHORT_ROWS // scale} of {ROWS // scale} rows); {rounds} rounds x {calls} calls timed on rank 0"
    )
    print_table(title, rows, "us/call", 1e6)
    check_target("fabric uneven vs fabric equal", samples["fabric uneven"], samples["fabric equal"], TARGET)
    return 0


if __name__ == "__main__":
    sys.exit(main())

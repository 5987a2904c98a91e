"""What recording each collective for hang diagnosis costs: all_reduce of a small tensor on 2 gloo CPU ranks.

Both ranks are started as torchrun would, with fabric's `ddp` strategy. In each process, blocks of timed
all_reduces alternate between raw `dist.all_reduce`, `fabric.all_reduce` with recording (the default) and
`fabric.all_reduce` with recording switched off for the block (the group's recorder set aside), so the three see
the same machine state. The difference between the last two is the recording's cost per collective, within
gloo's own noise; the calling-thread cost alone (enter/leave of the recording context, no collective) is timed
separately, in batches of 1000. A second job runs with FABRIC_DEBUG_COLLECTIVES=1, to show what the cross-rank
check of debug mode costs (a store round trip per collective; not meant for production runs).

Run:  python benchmarks/collective_record_overhead.py [--rounds 5]
      python benchmarks/collective_record_overhead.py --smoke     # one short round: checks it runs, no numbers
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from _common import HERE, Row, emit, print_table, run_two_ranks

WORLD_SIZE = 2
TARGET_US = 50.0  # the project's target for the calling-thread cost of recording one collective
# (timed all_reduces per block, blocks per mode, batches of 1000 calls for the calling-thread cost)
SIZES = {"full": (200, 10, 30), "smoke": (20, 2, 3)}


def worker(size: str) -> None:
    """One rank: alternate the modes block by block; rank 0 prints the per-collective times."""
    import torch
    import torch.distributed as dist

    from fabric import Fabric
    from fabric.diagnostics import track

    torch.set_num_threads(1)
    ops, blocks, batches = SIZES[size]
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=WORLD_SIZE)
    fabric.launch()
    tensor = torch.ones(4)
    world = dist.group.WORLD
    recorder = track._RECORDERS[world]  # set aside for the "recording off" blocks, then put back

    def without_recording() -> None:
        track._RECORDERS.pop(world)
        track._LAST[:] = [lambda: None, None]
        try:
            fabric.all_reduce(tensor)
        finally:
            track._RECORDERS[world] = recorder

    modes: dict[str, Callable[[], Any]] = {
        "raw dist.all_reduce": lambda: dist.all_reduce(tensor.clone()),
        "fabric, recording off": without_recording,
        "fabric, recording on": lambda: fabric.all_reduce(tensor),
    }
    times: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(3 * ops):  # warm up gloo's connections and the code paths
        fabric.all_reduce(tensor)
    for block in range(blocks):
        names = list(modes)
        for name in names[block % 3 :] + names[: block % 3]:
            fabric.barrier()
            call = modes[name]
            for _ in range(ops):
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
    # On every rank, so that their collective counts stay equal; not in debug mode, where each call would be a
    # cross-rank check (the check itself is what the debug job's all_reduce rows measure).
    calling = {} if track.debug_enabled() else _calling_thread_cost(track, tensor, batches)
    if fabric.global_rank == 0:
        emit({"times": times, "calling_thread": calling})
    fabric.barrier()
    dist.destroy_process_group()


def _calling_thread_cost(track: Any, tensor: Any, batches: int) -> dict[str, list[float]]:
    """Seconds per enter+exit of the recording context, and of the plain timeout context it replaced (no op)."""
    from fabric.utilities.distributed import explain_timeout

    def words() -> tuple[str, str]:
        return "0:30:00", "x"

    contexts = {
        "recording context alone": lambda: track.collective("all_reduce", words, (tensor, "mean")),
        "plain timeout context alone": lambda: explain_timeout("all_reduce", "0:30:00", "x"),
    }
    result: dict[str, list[float]] = {name: [] for name in contexts}
    for _ in range(batches):
        for name, make in contexts.items():
            start = time.perf_counter()
            for _ in range(1000):
                with make():
                    pass
            result[name].append((time.perf_counter() - start) / 1000)
    return result


def launch(size: str, debug: bool) -> dict:
    """Start both ranks as torchrun would; return rank 0's JSON."""
    args = [str(HERE / "collective_record_overhead.py"), "--worker", size]
    return run_two_ranks(args, {"FABRIC_DEBUG_COLLECTIVES": str(int(debug))}, timeout=600)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="jobs per mode (fresh processes each)")
    parser.add_argument("--smoke", action="store_true", help="one short round: checks that it runs")
    parser.add_argument("--peer-python", help="accepted for run_all; the peers record nothing, so none is compared")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return 0
    from _common import machine_line, probe

    print(machine_line({"current": probe(sys.executable)}))
    size, rounds = ("smoke", 1) if args.smoke else ("full", args.rounds)
    times: dict[str, list[float]] = {}
    calling: dict[str, list[float]] = {}
    for _ in range(rounds):
        for debug in (False, True):
            data = launch(size, debug)
            for name, samples in data["times"].items():
                label = "fabric, FABRIC_DEBUG_COLLECTIVES=1" if debug and "recording on" in name else name
                if debug and "recording on" not in name:
                    continue  # the other modes do not depend on the switch; measured in the normal job
                times.setdefault(label, []).extend(samples)
            if not debug:
                for name, samples in data["calling_thread"].items():
                    calling.setdefault(name, []).extend(samples)
    off = times["fabric, recording off"]
    rows = [Row(name, samples, None if samples is off else off) for name, samples in times.items()]
    ops, blocks, _ = SIZES[size]
    print_table(
        f"all_reduce of 4 floats, {WORLD_SIZE} CPU ranks (gloo), {rounds} jobs x {blocks} blocks x {ops} calls per "
        "mode, timed on rank 0; ratios to fabric with recording off",
        rows,
        "us/call",
        1e6,
    )
    plain = calling["plain timeout context alone"]
    print_table(
        "Calling-thread cost of the recording context alone (batches of 1000 calls); ratio to the plain context",
        [Row(name, samples, None if samples is plain else plain) for name, samples in calling.items()],
        "us/call",
        1e6,
    )
    cost = _median(calling["recording context alone"]) * 1e6
    in_loop = (_median(times["fabric, recording on"]) - _median(off)) * 1e6
    print(f"recording overhead per collective: {cost:.1f} us on the calling thread; {in_loop:+.1f} us in the loop")
    verdict = "PASS" if cost < TARGET_US else "FAIL"
    print(f"target: calling-thread cost of recording < {TARGET_US:.0f} us -> {cost:.1f} us: {verdict}")
    return 0


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


if __name__ == "__main__":
    sys.exit(main())

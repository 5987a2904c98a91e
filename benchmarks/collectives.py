"""One collective against the raw torch call that gives the same result, on 2 gloo CPU ranks, 1 thread each.

One case per row of the zero-cost issue:
- all_gather of 4 KB and of 1 MB per rank (float32), equal shapes: `dist.all_gather_single` (all_gather_into_tensor)
  into a preallocated `(2 * numel,)` tensor viewed as `(2, *shape)`, against `fabric.all_gather(x)`;
- all_reduce of 4 KB and of 1 MB, the default mean: a clone, `dist.all_reduce`, an in-place division (the input is
  left unchanged, as fabric's is), against `fabric.all_reduce(x)`;
- barrier: `dist.barrier()` against `fabric.barrier()`.

Each job is 2 ranks started as torchrun would start them (`_common.run_two_ranks`), with one framework: `fabric`
or, where importable, Lightning Fabric (`lightning_fabric`, the same calls). Inside a job, raw torch and the framework
alternate call by call (the order flips every call, `round_order`), each call timed alone, so both see the same
machine state: a barrier's time is mostly the two processes waking each other, and it drifts by 2x and more over
blocks of calls (blocks of 100 gave per-round ratios from 0.9x to 1.55x); alternating single calls pairs them.
A job's sample for a case is the median over its calls. Every round starts a fresh job per framework, in the order
`round_order` gives; the ratio of a round is framework / raw of the same job, reported as the median and p25-p75
over the rounds.

Run:  python benchmarks/collectives.py [--rounds 9] [--cases barrier "all_gather 4 KB"]
      python benchmarks/collectives.py --smoke        # one short round: checks that it runs, no numbers
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from _common import HERE, MIN_ROUNDS, Row, emit, load_line, print_ratio, print_table, round_order, run_two_ranks

WORLD_SIZE = 2
TARGET = 1.05
# case -> (operation, float32 elements per rank); 4 KB = 1024 floats, 1 MB = 262144 floats
CASES = {
    "all_gather 4 KB": ("all_gather", 1024),
    "all_gather 1 MB": ("all_gather", 262144),
    "all_reduce 4 KB": ("all_reduce", 1024),
    "all_reduce 1 MB": ("all_reduce", 262144),
    "barrier": ("barrier", 0),
}
# (timed calls per contender and case, warm-up calls per case); 1 MB calls take about 1 ms, the others 0.1 ms
SIZES = {"full": (1500, 100), "smoke": (4, 2)}


def worker(framework: str, size: str, cases: str) -> None:
    """One rank of a job: time raw torch and `framework` block by block; rank 0 prints the medians."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    fab = __import__(framework).Fabric(accelerator="cpu", strategy="ddp", devices=WORLD_SIZE)
    fab.launch()
    torch.set_num_threads(1)  # a framework may have changed it during setup
    calls, warmup = SIZES[size]
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    result: dict[str, dict[str, float]] = {}
    for case in cases.split(","):
        op, numel = CASES[case]
        x = torch.randn(numel)
        contenders = {"raw": _raw(op, x, dist, gather_single), "framework": _framework(op, x, fab)}
        for _ in range(warmup):
            for call in contenders.values():
                call()
        dist.barrier()
        result[case] = _alternate(contenders, calls)
    if fab.global_rank == 0:
        emit({"cases": result})
    dist.barrier()
    dist.destroy_process_group()


def _alternate(contenders: dict[str, Callable[[], Any]], calls: int) -> dict[str, float]:
    """Median time per call of each contender, the contenders called in turn (the order flips every call)."""
    clock = time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in contenders}
    orders = [round_order(list(contenders), index) for index in range(4)]  # a cycle of orders
    for index in range(calls):
        for name in orders[index % 4]:
            call = contenders[name]
            start = clock()
            call()
            times[name].append(clock() - start)
    return {name: statistics.median(samples) for name, samples in times.items()}


def _raw(op: str, x: Any, dist: Any, gather_single: Callable[..., Any]) -> Callable[[], Any]:
    """The raw torch call that gives what fabric's gives: a new tensor, the input unchanged."""
    if op == "all_gather":

        def gather() -> Any:
            out = x.new_empty(WORLD_SIZE * x.numel())
            gather_single(out, x.reshape(-1))
            return out.view(WORLD_SIZE, *x.shape)

        return gather
    if op == "all_reduce":

        def reduce() -> Any:
            out = x.clone()
            dist.all_reduce(out)
            return out.div_(WORLD_SIZE)

        return reduce
    return dist.barrier


def _framework(op: str, x: Any, fab: Any) -> Callable[[], Any]:
    if op == "all_gather":
        return lambda: fab.all_gather(x)
    if op == "all_reduce":
        return lambda: fab.all_reduce(x)
    return fab.barrier


def launch(framework: str, size: str, cases: list[str]) -> dict:
    """Start a 2-rank job of `framework` as torchrun would; return rank 0's per-case medians."""
    data = run_two_ranks([str(HERE / "collectives.py"), "--worker", framework, size, ",".join(cases)], {}, timeout=600)
    return data["cases"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS, help=f"fresh jobs per framework (>= {MIN_ROUNDS})")
    parser.add_argument("--smoke", action="store_true", help="one short round: checks that it runs")
    parser.add_argument("--peer-python", help="accepted for run_all; Lightning Fabric is used where importable here")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), metavar="CASE", help="only these cases (quoted)")
    parser.add_argument("--worker", nargs=3, metavar=("FRAMEWORK", "SIZE", "CASES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    from _common import machine_line, probe

    print(machine_line({"current": probe(sys.executable)}))
    print(load_line())
    size, rounds = ("smoke", 1) if args.smoke else ("full", max(args.rounds, MIN_ROUNDS))
    frameworks = ["fabric"]
    if not args.smoke and importlib.util.find_spec("lightning_fabric") is not None:
        frameworks.append("lightning_fabric")
    elif not args.smoke:
        print("skipped: lightning_fabric: not importable by this interpreter")
    # samples[framework][case] = {"raw": [...], "framework": [...]}, one value per round
    cases = args.cases or list(CASES)
    samples: dict[str, dict[str, dict[str, list[float]]]] = {
        fw: {case: {"raw": [], "framework": []} for case in cases} for fw in frameworks
    }
    for index in range(rounds):
        for fw in round_order(frameworks, index):
            for case, medians in launch(fw, size, cases).items():
                for name, value in medians.items():
                    samples[fw][case][name].append(value)
    calls, _ = SIZES[size]
    ok = True
    for case in cases:
        raw = samples["fabric"][case]["raw"]
        rows = [Row("raw torch", raw)]
        for fw in frameworks:
            rows.append(Row(fw, samples[fw][case]["framework"], samples[fw][case]["raw"], "vs raw of its own job"))
        print_table(
            f"{case}, {WORLD_SIZE} CPU ranks (gloo), 1 thread; {rounds} rounds x {calls} alternated calls",
            rows,
            "us/call",
            1e6,
        )
        for fw in frameworks:
            target = TARGET if fw == "fabric" else None
            ok &= print_ratio(f"{case} {fw} / raw", samples[fw][case]["framework"], samples[fw][case]["raw"], target)
    print(f"targets (fabric <= {TARGET:.2f}x raw, median of the per-round ratios): {'PASS' if ok else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

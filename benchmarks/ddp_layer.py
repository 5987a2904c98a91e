"""fabric's layer over one DDP module, in one process: the CPU time each of fabric's calls adds to a tiny DDP step.

`ddp_step.py` times the step on 2 gloo ranks, where every step waits for the other rank and the rank's gloo threads
share its core: there the CPU time of rank 0's main thread still moves by about +-15 us from round to round, as much
as fabric's whole layer. Here one process runs DDP over a gloo group of one: the reducer, its autograd hooks and
its all-reduce calls run as on 2 ranks, but nothing waits for a peer, so the same figures come within about +-4 us.

fabric's forward guard (see `fabric/_mistakes.py`) is installed as `fabric.setup` installs it for several
processes: with one process nothing can go around the strategy, so setup leaves it out, but on 2 ranks every
forward pays it, and that is what is measured. Raw DDP steps the very DDP module, optimizer and batches fabric set
up (the guard set aside outside its time), as in `ddp_step.py --same-model`; next to it run its control (a second
copy), fabric's whole step, and each of fabric's three calls alone in an otherwise raw step (`--components` there):
the model call (wrapper and guard), `fabric.backward` and the wrapped optimizer's `step`. The contenders take
turns step by step in a fresh random order; each round gives one CPU time per step per contender (the median of its
steps), and each line reports the median and p25-p75 of the per-round differences to raw DDP.

Run:  python benchmarks/ddp_layer.py [--rounds 40] [--steps 400]
      python benchmarks/ddp_layer.py --smoke     # 2 short rounds: does it run?
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
from typing import NoReturn

from _common import Row, load_line, machine_line, print_ratio, print_table, probe
from ddp_step import COMPONENTS, MODELS, _same_model_steps
from step_overhead import alternate, no_op

LABELS = {"raw": "raw DDP", "raw2": "raw, 2nd copy (control)", "fabric": "fabric", **COMPONENTS}


def _steps(steps: int) -> tuple[dict, dict]:
    """Every contender's step function on one model set up by fabric on a gloo group of one, with fabric's guard."""
    from unittest import mock

    import torch

    from fabric import Fabric

    with socket.socket() as s:  # a free port for the group's store
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=1)
    fabric.launch()
    widths, batch = MODELS["tiny"][:2]
    # setup guards the forward only where several processes could drift apart: pretend there are two.
    with mock.patch.object(Fabric, "world_size", new_callable=mock.PropertyMock, return_value=2):
        fns, around = _same_model_steps(widths, batch, steps, fabric)
    if not around:  # the raw contenders set the guard aside: none means setup installed none
        raise RuntimeError("fabric.setup installed no forward guard: this script measures nothing it is meant to")
    return {name: fns[name] for name in LABELS}, around


def _report(cpu: dict[str, list[float]]) -> None:
    base = cpu["raw"]
    title = f"CPU time per step, tiny MLP {'->'.join(map(str, MODELS['tiny'][0]))}, DDP on a gloo group of one"
    rows = [Row(LABELS[name], cpu[name], None if name == "raw" else base) for name in cpu]
    print_table(title, rows, "us/step", 1e6)
    for name in list(cpu)[1:]:
        print_ratio(f"{name} / raw, CPU", cpu[name], base)
        diffs = sorted((a - b) * 1e6 for a, b in zip(cpu[name], base, strict=True))
        low, high = (statistics.quantiles(diffs, n=4)[0::2]) if len(diffs) > 1 else (diffs[0], diffs[0])
        print(f"CPU difference {name} - raw: {statistics.median(diffs):+.1f} us/step (p25-p75 {low:+.1f} to "
              f"{high:+.1f}, median of the rounds)")  # fmt: skip


def main() -> NoReturn:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=400, help="steps per contender and round")
    parser.add_argument("--peer-python", help=argparse.SUPPRESS)  # run_all passes it; no peer can share the model
    parser.add_argument("--smoke", action="store_true", help="2 rounds of 20 steps")
    args = parser.parse_args()
    rounds, steps = (2, 20) if args.smoke else (max(args.rounds, 2), args.steps)
    print(machine_line({"current": probe(sys.executable)}))
    print(load_line())
    fns, around = _steps(steps)
    for name, step in fns.items():  # warm up: allocator, DDP's bucket rebuild after the first step, lazy imports
        before, after = around.get(name, (no_op, no_op))
        for index in range(2 if args.smoke else 300):
            before()
            step(index)
            after()
    cpu: dict[str, list[float]] = {}
    alternate(fns, steps, rounds, around, cpu)
    print(f"{rounds} rounds x {steps} steps per contender, in a fresh random order every step, 1 thread")
    _report(cpu)
    import torch.distributed as dist

    dist.destroy_process_group()
    # Leave without freeing the DDP module after its group is gone (see the end of ddp_step.worker).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

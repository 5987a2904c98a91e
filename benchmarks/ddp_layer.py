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
import sys
from typing import NoReturn

from _common import Row, free_port, load_line, machine_line, print_table, probe
from ddp_step import COMPONENTS, MODELS, _same_model_steps, leave, print_cpu_differences, warm_up
from step_overhead import FRAMEWORK_LABELS, all_steps, alternate

NAMES = ("raw", "raw2", "fabric", *COMPONENTS)
LABELS = FRAMEWORK_LABELS | COMPONENTS | {"raw": "raw DDP"}


def _steps(steps: int) -> tuple[dict, dict]:
    """Every contender's step function on one model set up by fabric on a gloo group of one, with fabric's guard."""
    from unittest import mock

    import torch

    from fabric import Fabric

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=1)
    fabric.launch()
    widths, batch = MODELS["tiny"][:2]
    # setup guards the forward only where several processes could drift apart: pretend there are two.
    with mock.patch.object(Fabric, "world_size", new_callable=mock.PropertyMock, return_value=2):
        fns, around = _same_model_steps(widths, batch, steps, fabric)
    if not around:  # the raw contenders set the guard aside: none means setup installed none
        raise RuntimeError("fabric.setup installed no forward guard: this script measures nothing it is meant to")
    return {name: fns[name] for name in NAMES}, around


def _report(cpu: dict[str, list[float]]) -> None:
    title = f"CPU time per step, tiny MLP {'->'.join(map(str, MODELS['tiny'][0]))}, DDP on a gloo group of one"
    rows = [Row(LABELS[name], cpu[name], None if name == "raw" else cpu["raw"]) for name in cpu]
    print_table(title, rows, "us/step", 1e6)
    print_cpu_differences(cpu)


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
    runs = {name: all_steps(step, steps) for name, step in fns.items()}
    warm_up(runs, around, 1 if args.smoke else max(1, 300 // steps))  # at least 300 steps each
    cpu: dict[str, list[float]] = {}
    alternate(fns, steps, rounds, around, cpu)
    print(f"{rounds} rounds x {steps} steps per contender, in a fresh random order every step, 1 thread")
    _report(cpu)
    leave()  # without freeing the DDP module after its group is gone (see ddp_step.leave)


if __name__ == "__main__":
    main()

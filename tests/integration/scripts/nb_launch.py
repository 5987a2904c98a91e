"""Typed into an interactive session (the test pipes this text to `python -` or `python -i`; never run as a file).

Usage: python - STRATEGY [STRATEGY ...] < nb_launch.py. Each strategy in turn, in the same session, after a line
that names it: with ddp_notebook / ddp_fork, the function defined here in __main__ runs in 2 forked workers and
rank 0's result is printed; with ddp, the error fabric.launch() raises is printed (it starts no process).
"""

import os
import sys

import torch

import __main__
from fabric import Fabric

print("HAS_FILE", hasattr(__main__, "__file__"), flush=True)


def train(fabric, offset):
    total = fabric.all_reduce(torch.tensor(float(fabric.global_rank + offset)), reduce_op="sum")
    return {"sum": total.item(), "world_size": fabric.world_size, "pid": os.getpid()}


# No blank line inside a block: the interactive session would end the block there.
def session(strategy):
    print("STRATEGY", strategy, flush=True)
    try:
        result = Fabric(accelerator="cpu", strategy=strategy, devices=2).launch(train, 1)
        print("RESULT", result["sum"], result["world_size"], result["pid"] != os.getpid(), flush=True)
    except RuntimeError as err:
        print("ERROR", err, flush=True)


for strategy in sys.argv[1:]:
    session(strategy)

"""What Lightning Fabric allows on 2 DDP ranks and fabric runs too, with a warning where it is easy to get wrong.

Usage: python lightning_allows_ddp.py OUTDIR. strategy="ddp" re-runs this script for rank 1. Each rank writes
OUTDIR/rank{N}.json with:
- player_*: first (while the DDP Fabric has set up no model), a second Fabric with
  SingleDeviceStrategy(device="cpu") inside the running group (sheeprl's player Fabric): its ranks, a local
  all_reduce, the threads it started, and whether the model it set up, trained by the DDP Fabric's backward
  (warned about once) with gradients averaged by hand, matches raw torch DDP;
- twice_*: the original module set up with fabric.setup(model), then again with fabric.setup(model, optimizer):
  the warnings, and whether training through both wrappers matches raw torch DDP and stays equal across ranks;
- outer_sum: an all_reduce of the DDP Fabric after all that.
From an atexit hook that runs after fabric's own, OUTDIR/rank{N}.exit.json says whether the group is still up.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

import torch
import torch.distributed as dist
from _it_common import outdir_from_argv, write_json

# The same model, data, raw DDP loop and checks as the mistakes script (both run on 2 gloo ranks).
from mistakes_ddp import batch, caught, equal_across_ranks, flat, make_model, raw_ddp_weights

from fabric import Fabric
from fabric.strategies import SingleDeviceStrategy


def set_up_twice(fabric: Fabric, rank: int, report: dict[str, Any]) -> None:
    module = make_model()
    models: list[Any] = []
    report["twice_first_warnings"] = caught(lambda: models.append(fabric.setup(module)))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    report["twice_warnings"] = caught(lambda: models.extend(fabric.setup(module, optimizer)))
    first, second, opt = models
    for step in range(3):
        model = first if step == 1 else second  # both wrappers train the same weights
        fabric.backward(model(batch(rank, step)).sum())
        opt.step()
        opt.zero_grad()
    report["twice_matches_raw_ddp"] = bool(torch.equal(flat(module), raw_ddp_weights(rank, 3)))
    report["twice_equal"] = equal_across_ranks(fabric, module)


def player_fabric(fabric: Fabric, rank: int, report: dict[str, Any]) -> None:
    threads = threading.active_count()
    strategy = SingleDeviceStrategy(device="cpu", accelerator=fabric.accelerator, precision=fabric.strategy.precision)
    player = Fabric(strategy=strategy)
    module = make_model()
    agent, opt = player.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    local = player.all_reduce(torch.tensor(float(rank + 1)), reduce_op="sum")
    report["player"] = [type(player.strategy).__name__, player.world_size, player.global_rank, local.item()]
    warned: list[str] = []
    for step in range(2):
        loss = agent(batch(rank, step)).sum()
        warned += caught(lambda loss=loss: fabric.backward(loss))  # no model of the DDP Fabric: a warning, once
        for p in module.parameters():  # the gradients averaged by hand, as sheeprl does
            p.grad = fabric.all_reduce(p.grad, reduce_op="mean")
        opt.step()
        opt.zero_grad()
    report["player_backward_warnings"] = warned
    report["player_matches_raw_ddp"] = bool(torch.equal(flat(module), raw_ddp_weights(rank, 2)))
    report["player_new_threads"] = threading.active_count() - threads
    report["group_alive"] = dist.is_initialized()


def main() -> None:
    outdir = outdir_from_argv()
    rank = int(os.environ.get("LOCAL_RANK", 0))
    # Registered before Fabric's own hook, so it runs after it (atexit is last in, first out).
    atexit.register(lambda: write_json(outdir / f"rank{rank}.exit.json", {"initialized": dist.is_initialized()}))
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    fabric.launch()
    report: dict[str, Any] = {}
    player_fabric(fabric, rank, report)  # first: the DDP Fabric has set up no model yet, as in sheeprl
    set_up_twice(fabric, rank, report)
    report["outer_sum"] = fabric.all_reduce(torch.tensor(float(rank + 1)), reduce_op="sum").item()
    fabric.barrier()
    write_json(outdir / f"rank{rank}.json", report)


if __name__ == "__main__":
    main()

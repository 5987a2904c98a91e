"""A 2-rank job for the tests of how jobs end: killed launchers, a hung rank, preemption.

Usage: python ends_job.py OUTDIR START SCENARIO [STEPS]
  START     ddp (fabric.launch() re-runs this script), spawn (fabric.launch(fn)), or external (torchrun,
            `fabric run` or srun started both processes)
  SCENARIO  train   small all_reduces for up to RUN_SECONDS, until a signal from the test ends the job
            hang0   rank 0 sleeps in its own code; rank 1's all_reduce times out after TIMEOUT
            raise1  rank 1 raises while rank 0 waits in an all_reduce
            sleep   both ranks sleep in their own code for RUN_SECONDS (the test kills one with SIGKILL)
            sleep_reduce  both ranks sleep in their own code for SLEEP_SECONDS (the test kills rank 1), then
                    all_reduce with a collective timeout of TIMEOUT
            preempt train STEPS steps with a checkpoint; on fabric.preempted save and exit 0; a rerun resumes
Every rank writes OUTDIR/rank{N}.pid.json once the process group is up.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from _it_common import outdir_from_argv, write_json, write_pid

from fabric import Fabric
from fabric.strategies import DDPStrategy

TIMEOUT = timedelta(seconds=3)  # hang0: the collective that times out
# Other scenarios: long enough that no collective times out on a loaded machine and changes which rank fails first.
RELAXED_TIMEOUT = timedelta(seconds=60)
RUN_SECONDS = 40  # far longer than any test waits: the signal, not the loop, must end the job
STEP_SECONDS = 0.1
SLEEP_SECONDS = 5  # sleep_reduce: the test kills rank 1 meanwhile
FAILURE = "integration-test-failure-e2d7: rank 1 raised on purpose"


class SavingCallback:
    """Saves the checkpoint when the job is preempted, through fabric's callbacks."""

    def __init__(self, outdir: Path) -> None:
        self.outdir = outdir
        self.state: dict[str, Any] = {}

    def on_preempt(self, fabric: Fabric) -> None:
        fabric.save(self.outdir / "ckpt.pt", self.state)
        write_json(self.outdir / f"rank{fabric.global_rank}.preempted.json", {"step": self.state["step"]})


def train(fabric: Fabric, outdir: Path, scenario: str, steps: int) -> None:
    rank = fabric.global_rank
    fabric.barrier()
    write_pid(outdir, rank)
    if scenario == "hang0":
        if rank == 0:
            time.sleep(RUN_SECONDS)
        fabric.all_reduce(torch.ones(1))
        write_json(outdir / f"rank{rank}.unexpected.json", {"passed_collective": True})
        return
    if scenario == "raise1":
        if rank == 1:
            time.sleep(0.5)  # let rank 0 block in the all_reduce first
            write_json(outdir / "failed_at.json", {"time": time.time(), "rank": rank})
            raise RuntimeError(FAILURE)
        fabric.all_reduce(torch.ones(1))
        write_json(outdir / f"rank{rank}.unexpected.json", {"passed_collective": True})
        return
    if scenario == "sleep_reduce":
        time.sleep(SLEEP_SECONDS)
        fabric.all_reduce(torch.ones(1))
        write_json(outdir / f"rank{rank}.unexpected.json", {"passed_collective": True})
        return
    if scenario == "sleep":
        time.sleep(RUN_SECONDS)
        write_json(outdir / f"rank{rank}.unexpected.json", {"slept_to_the_end": True})
        return
    if scenario == "train":
        deadline = time.monotonic() + RUN_SECONDS
        while time.monotonic() < deadline:
            fabric.all_reduce(torch.ones(1))
            time.sleep(0.05)
        write_json(outdir / f"rank{rank}.unexpected.json", {"ran_to_the_end": True})
        return
    preempt(fabric, outdir, steps)


def preempt(fabric: Fabric, outdir: Path, steps: int) -> None:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    saver = fabric._callbacks[0]
    saver.state.update(model=model, optimizer=optimizer, step=0)
    checkpoint = outdir / "ckpt.pt"
    if checkpoint.exists():
        fabric.load(checkpoint, saver.state)
    started = saver.state["step"]
    write_json(outdir / f"rank{fabric.global_rank}.start.json", {"step": started})
    while saver.state["step"] < steps:
        if fabric.preempted:
            return  # on_preempt saved the checkpoint
        x = torch.full((8, 4), float(saver.state["step"]))
        fabric.backward(model(x).sum())
        optimizer.step()
        optimizer.zero_grad()
        saver.state["step"] += 1
        if saver.state["step"] == started + 3:  # the test signals once training is under way
            write_json(outdir / f"rank{fabric.global_rank}.trained.json", {"step": saver.state["step"]})
        time.sleep(STEP_SECONDS)
    write_json(outdir / f"rank{fabric.global_rank}.finished.json", {"step": saver.state["step"]})


def main() -> None:
    outdir = outdir_from_argv()
    start, scenario = sys.argv[2], sys.argv[3]
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    timeout = TIMEOUT if scenario in ("hang0", "sleep_reduce") else RELAXED_TIMEOUT
    strategy = DDPStrategy(timeout=timeout, start_method="spawn" if start == "spawn" else "popen")
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2, callbacks=[SavingCallback(outdir)])
    if start == "spawn":
        fabric.launch(train, outdir, scenario, steps)
        return
    fabric.launch()
    train(fabric, outdir, scenario, steps)


if __name__ == "__main__":
    main()

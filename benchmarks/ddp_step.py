"""DDP step time with 2 CPU processes over gloo: raw torch.distributed DDP against fabric's `ddp` strategy.

Every contender's two processes are started the same way, as torchrun would (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT in the environment), so only the training step differs: raw code joins the group and
wraps the model in DistributedDataParallel itself; fabric (and, with --peer-python, Lightning Fabric and
Accelerate) detect the environment and do it in `setup`/`prepare`. Each rank trains on its own pre-made
tensors with one thread; rank 0 times every step after a warmup. Contenders run round-robin for several rounds.

Run:  python benchmarks/ddp_step.py [--rounds 5] [--peer-python /path/to/bench-venv/bin/python]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from typing import Any

from _common import HERE, Row, check_target, emit, print_table, run_json
from _common import contenders as common_contenders

# name -> (layer widths, batch size per rank, warmup steps, timed steps)
MODELS: dict[str, tuple[tuple[int, ...], int, int, int]] = {
    "tiny": ((32, 64, 64, 10), 32, 100, 1000),
    "small": ((256, 1024, 1024, 256), 64, 10, 150),
}
WORLD_SIZE = 2
TARGET = 1.02
WORKER_TIMEOUT_S = 180


def worker(framework: str, model_name: str) -> None:
    """One rank: set up with `framework`, warm up, time each step; rank 0 prints the step times."""
    import faulthandler

    import torch
    import torch.distributed as dist
    from step_overhead import make_mlp
    from torch.nn.functional import cross_entropy

    # A rank that hangs (a lost peer, a stuck shutdown) prints where, for the retry message, and exits.
    faulthandler.dump_traceback_later(WORKER_TIMEOUT_S, exit=True)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    widths, batch, warmup, steps = MODELS[model_name]
    torch.manual_seed(0)
    model: Any = make_mlp(widths)
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    xs = torch.randn(16, batch, widths[0], generator=gen)
    batches = list(zip(xs, torch.randint(0, widths[-1], (16, batch), generator=gen), strict=True))

    backward = lambda loss: loss.backward()  # noqa: E731
    if framework == "raw":
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo")
        model = DistributedDataParallel(model)
    elif framework in ("fabric", "lightning_fabric"):
        fab = __import__(framework).Fabric(accelerator="cpu", strategy="ddp", devices=WORLD_SIZE)
        fab.launch()
        model, optimizer = fab.setup(model, optimizer)
        backward = fab.backward
    elif framework == "accelerate":
        from accelerate import Accelerator

        acc = Accelerator(cpu=True)
        model, optimizer = acc.prepare(model, optimizer)
        backward = acc.backward
    torch.set_num_threads(1)  # a framework may have changed it during setup

    times = []
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
        start = time.perf_counter()
        x, y = batches[i % len(batches)]
        loss = cross_entropy(model(x), y)
        optimizer.zero_grad()
        backward(loss)
        optimizer.step()
        times.append(time.perf_counter() - start)
    dist.barrier()
    if rank == 0:
        emit({"step_s": times[warmup:], "world_size": dist.get_world_size(), "backend": dist.get_backend()})
    dist.destroy_process_group()


def launch(python: str, framework: str, model_name: str, attempts: int = 2) -> dict:
    """Start both ranks as torchrun would; return rank 0's JSON. Retried once: a free port can be taken meanwhile."""
    for attempt in range(1, attempts + 1):
        try:
            return _launch_once(python, framework, model_name)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            print(f"{framework} {model_name}: attempt {attempt} failed: {str(err)[-1500:]}")
    raise RuntimeError(f"{framework} {model_name}: failed {attempts} times")


def _launch_once(python: str, framework: str, model_name: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD_SIZE)}
    env |= {"LOCAL_WORLD_SIZE": str(WORLD_SIZE), "GROUP_RANK": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    argv = [python, str(HERE / "ddp_step.py"), "--worker", framework, model_name]
    others = [
        subprocess.Popen(
            argv,
            cwd=HERE,
            env={**os.environ, **env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for r in range(1, WORLD_SIZE)
    ]
    try:
        data, _ = run_json(python, argv[1:], env={**env, "RANK": "0", "LOCAL_RANK": "0"}, timeout=300)
    finally:
        for proc in others:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="round-robin rounds (fresh processes each)")
    parser.add_argument("--peer-python", help="interpreter with lightning-fabric and accelerate installed")
    parser.add_argument("--worker", nargs=2, metavar=("FRAMEWORK", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0

    contenders = common_contenders("raw DDP", args.peer_python)

    for model_name, (widths, batch, _, steps) in MODELS.items():
        samples: dict[str, list[float]] = {c[0]: [] for c in contenders}
        for r in range(args.rounds):
            k = r % len(contenders)
            for label, py, fw, _ in contenders[k:] + contenders[:k]:
                data = launch(py, fw, model_name)
                samples[label] += data["step_s"]
                assert data["world_size"] == WORLD_SIZE, data
        rows = [Row(lab, samples[lab], None if lab == base else samples[base]) for lab, _, _, base in contenders]
        title = (
            f"DDP, {WORLD_SIZE} CPU processes (gloo), {model_name} MLP {'->'.join(map(str, widths))}, batch {batch}"
            f"/rank; {args.rounds} rounds x {steps} steps timed on rank 0, 1 thread/rank"
        )
        print_table(title, rows, "us/step", 1e6)
        if "fabric" in samples:
            check_target("fabric vs raw DDP", samples["fabric"], samples["raw DDP"], TARGET)
    return 0


if __name__ == "__main__":
    sys.exit(main())

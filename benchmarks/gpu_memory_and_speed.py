"""Several GPUs: peak memory per rank of FSDP and DeepSpeed ZeRO stage 3 against DDP, and bf16 step time.

Memory: a language-model-shaped network (token embedding, 12 pre-norm residual MLP blocks of width 1024, a
vocabulary head; about 170M parameters) trains with AdamW in `32-true` under `strategy="ddp"`,
`FSDPStrategy(auto_wrap_policy={block})` and `DeepSpeedStrategy(stage=3)` on the same N GPUs, each strategy in a
fresh launch of N processes (with --device cpu, where nothing is measured, one launch runs them all). The model is
built under `fabric.init_module()`, as a user would. Reported per rank: torch.cuda.max_memory_allocated over setup
and training, and its ratio to DDP on the same rank. Sharding should divide the parameter, gradient and optimizer
memory by about N; activations are not sharded.

Speed: on the same N GPUs, in one launch, raw `DistributedDataParallel` with `torch.autocast("cuda",
torch.bfloat16)` against fabric's `strategy="ddp", precision="bf16-mixed"`, the same model and batches,
alternating R repeats of K steps timed with torch.cuda.synchronize() on rank 0. Reported: ms per step and the
ratio fabric / raw. With --device cpu --smoke (a code-path check, no numbers to keep) the speed code path runs in
the memory launch's processes, after the strategies.

Needs a CUDA GPU (2 or more for sharding to mean anything); without one it says so and exits with status 1.
Run:  python benchmarks/gpu_memory_and_speed.py [--gpus N]          # default: every visible GPU
      python benchmarks/gpu_memory_and_speed.py --device cpu --smoke  # 2 CPU processes, a tiny model: checks the
                                                                     # code paths only, measures no GPU
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from _common import Row, machine_line, print_table, probe

# (vocabulary, width, blocks, unused, sequence length, batch per rank, warmup steps, repeats, steps per repeat)
SIZES = {"large": (32000, 1024, 12, 0, 512, 8, 5, 5, 10), "smoke": (128, 32, 2, 0, 16, 4, 1, 2, 2)}
STRATEGIES = ("ddp", "fsdp", "deepspeed stage 3")
NO_GPU = (
    "gpu_memory_and_speed.py: no CUDA GPU is visible (torch.cuda.device_count() is 0), so there is nothing to "
    "measure. Run it on a machine with GPUs, or pass --device cpu --smoke to check the code paths on the CPU."
)


def make_model(size: str) -> Any:
    """Embedding, a stack of residual MLP blocks (the unit FSDP wraps), and a head back to the vocabulary."""
    from torch import nn

    vocab, width, layers = SIZES[size][:3]
    return nn.Sequential(nn.Embedding(vocab, width), *(_block()(width) for _ in range(layers)), nn.Linear(width, vocab))


def _block() -> type:
    """A pre-norm residual MLP block; defined on first use so that torch is imported only in the workers."""
    global _BLOCK
    if _BLOCK is None:
        from torch import Tensor, nn

        class Block(nn.Module):
            def __init__(self, width: int) -> None:
                super().__init__()
                self.norm = nn.LayerNorm(width)
                self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

            def forward(self, x: Tensor) -> Tensor:
                return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

        _BLOCK = Block
    return _BLOCK


_BLOCK: type | None = None


def _strategy(name: str) -> Any:
    if name == "fsdp":
        from fabric.strategies import FSDPStrategy

        return FSDPStrategy(auto_wrap_policy={_block()})
    if name == "deepspeed stage 3":
        from fabric.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(stage=3)
    return name


def _batch(size: str, rank: int, device: Any) -> tuple[Any, Any]:
    import torch

    vocab, _, _, _, seq, batch = SIZES[size][:6]
    gen = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen)
    return tokens.to(device), torch.randint(0, vocab, (batch, seq), generator=gen).to(device)


def _step_fn(model: Any, optimizer: Any, backward: Callable, context: Callable[[], AbstractContextManager]) -> Any:
    from torch.nn.functional import cross_entropy

    def step(tokens: Any, targets: Any) -> None:
        optimizer.zero_grad(set_to_none=True)
        with context():
            loss = cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())
        backward(loss)
        optimizer.step()

    return step


def worker(kinds: str, names: str, device: str, size: str, devices: int, out: str) -> None:
    """One rank of a launch: each of KINDS (`memory`, `speed`, joined by '+') in turn; its results as JSON in OUT."""
    rank = 0
    result: dict = {}
    for kind in kinds.split("+"):
        if kind == "memory":
            rank, payload = memory_worker(names, device, size, devices)
        else:
            rank, payload = speed_worker(device, size, devices)
        result |= payload
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(result))


def memory_worker(names: str, device: str, size: str, devices: int) -> tuple[int, dict]:
    """One rank of each strategy in NAMES (joined by '+'): build under init_module, train; its rank and peaks."""
    import torch

    from fabric import Fabric

    peaks: dict[str, float | None] = {}
    for name in names.split("+"):
        fabric = Fabric(accelerator=device, strategy=_strategy(name), devices=devices, precision="32-true")
        fabric.launch()
        cuda = fabric.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(fabric.device)
        with fabric.init_module():
            model = make_model(size)
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        step = _step_fn(model, optimizer, fabric.backward, nullcontext)
        tokens, targets = _batch(size, fabric.global_rank, fabric.device)
        for _ in range(sum(SIZES[size][6:8])):
            step(tokens, targets)
        peaks[name] = torch.cuda.max_memory_allocated(fabric.device) / 2**20 if cuda else None
    return fabric.global_rank, {"peaks": peaks}


def speed_worker(device: str, size: str, devices: int) -> tuple[int, dict]:
    """raw DDP + autocast and fabric bf16-mixed in the same processes, alternating timed repeats; rank, times."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from fabric import Fabric

    fabric = Fabric(accelerator=device, strategy="ddp", devices=devices, precision="bf16-mixed")
    fabric.launch()
    dev = fabric.device
    torch.manual_seed(0)
    ids = [dev.index] if dev.type == "cuda" else None
    raw_model = DistributedDataParallel(make_model(size).to(dev), device_ids=ids)
    raw_opt = torch.optim.AdamW(raw_model.parameters(), lr=1e-4)
    steps = {
        "raw": _step_fn(
            raw_model, raw_opt, lambda loss: loss.backward(), lambda: torch.autocast(dev.type, torch.bfloat16)
        ),
    }
    torch.manual_seed(0)
    model = make_model(size)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    steps["fabric"] = _step_fn(model, optimizer, fabric.backward, nullcontext)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    tokens, targets = _batch(size, fabric.global_rank, dev)
    _, _, _, _, _, _, warmup, repeats, count = SIZES[size]
    per_step: dict[str, list[float]] = {"raw": [], "fabric": []}
    for name in ("raw", "fabric"):
        for _ in range(warmup):
            steps[name](tokens, targets)
    for repeat in range(repeats):
        for name in ("raw", "fabric") if repeat % 2 == 0 else ("fabric", "raw"):
            sync()
            start = time.perf_counter()
            for _ in range(count):
                steps[name](tokens, targets)
            sync()  # CUDA runs asynchronously: count a step when the GPU has finished it
            per_step[name].append((time.perf_counter() - start) / count)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return fabric.global_rank, {**per_step, "device_name": gpu}


def _launch(kinds: str, names: list[str], device: str, size: str, devices: int) -> list[dict]:
    """Run this script as a worker (fabric's launcher starts the other ranks); every rank's JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result")
        worker_args = [kinds, "+".join(names) or "-", device, size, str(devices), out]
        proc = subprocess.run([sys.executable, __file__, "--worker", *worker_args], check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"worker {worker_args[:4]} exited with status {proc.returncode} (its output is above)")
        return [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(devices)]


def _measure(device: str, size: str, devices: int, smoke: bool) -> tuple[dict[str, list[float | None]], dict]:
    """Every rank's peak per strategy, and rank 0's step times."""
    import importlib.util

    # Without deepspeed installed its row says so; the other strategies are still measured.
    names = [n for n in STRATEGIES if n != "deepspeed stage 3" or importlib.util.find_spec("deepspeed")]
    if device == "cpu" and smoke:
        # Neither the memory (n/a on the CPU) nor a smoke run's step times are numbers to keep: one launch runs
        # every strategy's code path and then the speed one (a launch is seconds of imports per process).
        ranks = _launch("memory+speed", names, device, size, devices)
        return {name: [rank["peaks"][name] for rank in ranks] for name in names}, ranks[0]
    # A peak is a process's own, so on GPUs each strategy gets a fresh launch; the CPU measures nothing, and there
    # one launch runs every strategy's code path in turn.
    launches = [[name] for name in names] if device == "cuda" else [names]
    peaks: dict[str, list[float | None]] = {}
    for group in launches:
        ranks = _launch("memory", group, device, size, devices)
        peaks.update({name: [rank["peaks"][name] for rank in ranks] for name in group})
    return peaks, _launch("speed", [], device, size, devices)[0]


def _memory_table(peaks: dict[str, list[float | None]], size: str, devices: int) -> None:
    vocab, width, layers = SIZES[size][:3]
    print(f"\nPeak memory per rank, MB (torch.cuda.max_memory_allocated), 32-true, AdamW, {devices} processes:")
    print(f"{layers} MLP blocks of width {width}, vocab {vocab}; ratio to DDP on the same rank")
    header = f"{'strategy':<20}" + "".join(f"{'rank ' + str(r):>22}" for r in range(devices))
    print(header)
    print("-" * len(header))
    for name in STRATEGIES:
        if name not in peaks:
            print(f"{name:<20} skipped: deepspeed is not installed (pip install torchfabric[deepspeed])")
            continue
        cells = []
        for rank, peak in enumerate(peaks[name]):
            base = peaks["ddp"][rank]
            cells.append("n/a (cpu)" if peak is None or base is None else f"{peak:.0f} ({peak / base:.2f}x)")
        print(f"{name:<20}" + "".join(f"{c:>22}" for c in cells))


def _speed_table(rank0: dict, size: str, devices: int) -> None:
    _, width, layers, _, seq, batch, _, repeats, count = SIZES[size]
    rows = [
        Row("raw DDP + autocast bf16", rank0["raw"]),
        Row("fabric ddp bf16-mixed", rank0["fabric"], baseline=rank0["raw"]),
    ]
    title = (
        f"bf16 step time on {rank0['device_name']}, rank 0 of {devices}: {layers} MLP blocks of width {width}, batch "
        f"{batch}x{seq} per rank, {repeats} x {count} steps"
    )
    print_table(title, rows, "ms/step", 1e3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=None, help="how many GPUs (default: every visible one)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a code-path check only")
    parser.add_argument("--smoke", action="store_true", help="a tiny model (with --device cpu: 2 processes)")
    # Accepted so that run_all.py can pass it to every script; this one compares fabric with raw torch only.
    parser.add_argument("--peer-python", help="ignored: no peer library is measured here")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kinds, names, device, size, devices, out = args.worker
        worker(kinds, names, device, size, int(devices), out)
        return 0
    visible = 2  # --device cpu: 2 processes, and this process need not import torch (seconds) to count GPUs
    if args.device == "cuda":
        import torch

        visible = torch.cuda.device_count()
        if visible == 0:
            print(NO_GPU, file=sys.stderr)
            return 1
    devices = args.gpus or visible
    size = "smoke" if args.smoke else "large"
    print(machine_line({"current": probe(sys.executable)}))
    peaks, rank0 = _measure(args.device, size, devices, args.smoke)
    _memory_table(peaks, size, devices)
    _speed_table(rank0, size, devices)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-step overhead of fabric (and, with --peer-python, Lightning Fabric and Accelerate) over raw PyTorch.

One training step is forward, loss, zero_grad, backward, optimizer step, on one CPU process with one thread.
Cases: a tiny MLP (wrapper cost dominates) and a mid-size MLP, fed from pre-made tensors; and the tiny MLP fed
by a DataLoader (through `setup_dataloaders` / `prepare`, or raw). Every contender runs in its own fresh
process: warmup, then R repeats of K timed steps. Contenders run round-robin for several rounds; the table
shows the median per-step time over all repeats and its ratio to raw PyTorch in the same interpreter.

Run:  python benchmarks/step_overhead.py [--rounds 5] [--peer-python /path/to/bench-venv/bin/python]
      python benchmarks/step_overhead.py --profile 2000    # cProfile 2000 fabric steps of the tiny MLP
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable
from typing import Any

from _common import Row, check_target, emit, print_table, run_json
from _common import contenders as common_contenders

# name -> (layer widths, batch size, warmup steps, repeats, steps per repeat)
MODELS: dict[str, tuple[tuple[int, ...], int, int, int, int]] = {
    "tiny": ((32, 64, 64, 10), 32, 300, 60, 50),
    "mid": ((1024, 4096, 4096, 1024), 64, 2, 5, 3),
}
BENCHES = (("tiny", "tensors"), ("tiny", "loader"), ("mid", "tensors"))
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
TARGET = 1.03


def make_mlp(widths: tuple[int, ...]) -> Any:
    """Linear layers of the given widths with ReLU between them."""
    from torch import nn

    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(widths) - 2 else [])
    return nn.Sequential(*layers)


def _build(framework: str, model_name: str, variant: str, steps: int) -> tuple[Callable[[], None], Any]:
    """Set up model, optimizer and data with `framework`; return a function running one repeat of `steps`."""
    import torch
    from torch.nn.functional import cross_entropy

    torch.set_num_threads(1)
    torch.manual_seed(0)
    widths, batch = MODELS[model_name][:2]
    model: Any = make_mlp(widths)
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=1e-3)
    xs = torch.randn(steps * batch, widths[0])
    ys = torch.randint(0, widths[-1], (steps * batch,))
    loader: Any = None
    if variant == "loader":
        from torch.utils.data import DataLoader, TensorDataset

        loader = DataLoader(TensorDataset(xs, ys), batch_size=batch, shuffle=True)

    backward: Callable[[Any], None] = lambda loss: loss.backward()  # noqa: E731
    if framework in ("fabric", "lightning_fabric"):
        Fabric = __import__(framework).Fabric
        fab = Fabric(accelerator="cpu", devices=1)
        model, optimizer = fab.setup(model, optimizer)
        loader = fab.setup_dataloaders(loader) if loader is not None else None
        backward = fab.backward
    elif framework == "accelerate":
        from accelerate import Accelerator

        acc = Accelerator(cpu=True)
        model, optimizer = acc.prepare(model, optimizer)
        loader = acc.prepare(loader) if loader is not None else None
        backward = acc.backward
    torch.set_num_threads(1)  # a framework may have changed it during setup

    def step(x: Any, y: Any) -> None:
        loss = cross_entropy(model(x), y)
        optimizer.zero_grad()
        backward(loss)
        optimizer.step()

    batches = [(xs[i * batch : (i + 1) * batch], ys[i * batch : (i + 1) * batch]) for i in range(steps)]

    def run() -> None:
        for x, y in loader if loader is not None else batches:
            step(x, y)

    return run, model


def worker(framework: str, model_name: str, variant: str) -> None:
    """Runs in a fresh process: warm up, time the repeats, print per-step seconds as JSON."""
    import torch

    _, _, warmup, repeats, steps = MODELS[model_name]
    run, _ = _build(framework, model_name, variant, steps)
    for _ in range(max(1, round(warmup / steps))):
        run()
    per_step = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        per_step.append((time.perf_counter() - start) / steps)
    emit({"per_step_s": per_step, "threads": torch.get_num_threads()})


def profile(n_steps: int) -> None:
    """cProfile `n_steps` fabric steps of the tiny MLP; print the fabric-owned functions by cumulative time."""
    import cProfile
    import pstats
    from pathlib import Path

    import fabric

    run, _ = _build("fabric", "tiny", "tensors", n_steps)
    run()  # warm
    prof = cProfile.Profile()
    prof.runcall(run)
    stats = pstats.Stats(prof)
    root = str(Path(fabric.__file__).parent)
    own = [(k, v) for k, v in stats.stats.items() if k[0].startswith(root)]  # type: ignore[attr-defined]
    total = stats.total_tt  # type: ignore[attr-defined]
    self_time = sum(v[2] for _, v in own)
    print(f"cProfile, {n_steps} fabric steps (tiny MLP, 1 thread): {total * 1e6 / n_steps:.1f} us/step profiled,")
    print(f"fabric-owned self time {self_time * 1e6 / n_steps:.2f} us/step ({self_time / total:.1%} of profiled)")
    print(f"{'function':<60} {'calls/step':>10} {'self us/step':>13} {'cum us/step':>12}")
    for (file, line, name), (_, ncalls, tt, ct, _) in sorted(own, key=lambda kv: -kv[1][3])[:15]:
        where = f"{Path(file).relative_to(Path(root).parent)}:{line}({name})"
        print(f"{where:<60} {ncalls / n_steps:>10.1f} {tt * 1e6 / n_steps:>13.2f} {ct * 1e6 / n_steps:>12.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="round-robin rounds (a fresh process each)")
    parser.add_argument("--peer-python", help="interpreter with lightning-fabric and accelerate installed")
    parser.add_argument("--profile", type=int, metavar="STEPS", help="only profile fabric on the tiny MLP")
    parser.add_argument("--worker", nargs=3, metavar=("FRAMEWORK", "MODEL", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    if args.profile:
        profile(args.profile)
        return 0

    contenders = common_contenders("raw torch", args.peer_python)

    exceeded = False
    for model_name, variant in BENCHES:
        samples: dict[str, list[float]] = {c[0]: [] for c in contenders}
        for r in range(args.rounds):
            k = r % len(contenders)
            for label, py, fw, _ in contenders[k:] + contenders[:k]:
                data, _ = run_json(py, [__file__, "--worker", fw, model_name, variant], env=THREAD_ENV)
                samples[label] += data["per_step_s"]
        widths, batch, _, repeats, steps = MODELS[model_name]
        rows = [Row(lab, samples[lab], None if lab == base else samples[base]) for lab, _, _, base in contenders]
        title = (
            f"{model_name} MLP {'->'.join(map(str, widths))}, batch {batch}, data from {variant}; "
            f"{args.rounds} rounds x {repeats} repeats x {steps} steps, 1 thread"
        )
        print_table(title, rows, "us/step", 1e6)
        if "fabric" in samples and model_name == "tiny":
            exceeded |= not check_target("fabric vs raw torch", samples["fabric"], samples["raw torch"], TARGET)
    if exceeded:
        print("\nhint: python benchmarks/step_overhead.py --profile 2000   shows where fabric's time goes")
    return 0


if __name__ == "__main__":
    sys.exit(main())

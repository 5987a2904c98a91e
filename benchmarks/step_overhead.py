"""Per-step overhead of fabric and Lightning Fabric over raw PyTorch, on one CPU process with one thread.

One training step is forward, loss, zero_grad, backward, optimizer step. Cases: a tiny MLP (wrapper cost
dominates) and a mid-size MLP, fed from pre-made tensors; and the tiny MLP fed by a DataLoader (through
`setup_dataloaders`, or raw). Each case runs in one fresh process holding every contender (raw torch, fabric,
and Lightning Fabric / Accelerate where this interpreter can import them), each with its own copy of the same
model: they take turns step by step, the order flipping every step, each step timed alone, so a slow phase of
the machine hits all of them (blocks of steps drifted apart by up to 1.27x between contenders). Each round gives
one per-step time per contender (the median of its steps); the ratio to raw is reported as the median and
p25-p75 band of the per-round ratios.

Run:  python benchmarks/step_overhead.py [--rounds 15]
      python benchmarks/step_overhead.py --profile 2000    # cProfile 2000 fabric steps of the tiny MLP
      python benchmarks/step_overhead.py --smoke           # a quick run of the code paths: no numbers to keep
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from _common import MIN_ROUNDS, Row, emit, load_line, pooled_jobs, print_ratio, print_table, run_json, step_orders
from _common import contenders as common_contenders

# name -> (layer widths, batch size, steps per block, blocks per round and contender)
MODELS: dict[str, tuple[tuple[int, ...], int, int, int]] = {
    "tiny": ((32, 64, 64, 10), 32, 50, 5),
    "mid": ((1024, 4096, 4096, 1024), 64, 3, 1),
}
SMOKE_MODELS: dict[str, tuple[tuple[int, ...], int, int, int]] = {"tiny": ((32, 64, 64, 10), 32, 5, 1)}
BENCHES = (("tiny", "tensors"), ("tiny", "loader"), ("mid", "tensors"))
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
TARGET = 1.02
RAW = "raw torch"
FRAMEWORK_LABELS = {
    "raw": RAW,
    "raw2": "raw, 2nd copy (control)",
    "fabric": "fabric",
    "lightning_fabric": "lightning_fabric",
    "accelerate": "accelerate",
}


def make_mlp(widths: tuple[int, ...]) -> Any:
    """Linear layers of the given widths with ReLU between them."""
    from torch import nn

    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(widths) - 2 else [])
    return nn.Sequential(*layers)


def _build(framework: str, widths: tuple[int, ...], batch: int, variant: str, steps: int) -> Callable[[int], None]:
    """Set up model, optimizer and data with `framework`; return a function running one training step.

    From a loader, each step takes the next batch of the contender's own iterator (a new epoch when it ends), what
    `for x, y in loader:` does; from tensors, step `index` uses batch `index % steps`.
    """
    import torch
    from torch.nn.functional import cross_entropy

    torch.manual_seed(0)  # every contender starts from the same weights and data
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
        fab = __import__(framework).Fabric(accelerator="cpu", devices=1)
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

    if loader is None:
        batches = [(xs[i * batch : (i + 1) * batch], ys[i * batch : (i + 1) * batch]) for i in range(steps)]
        return lambda index: step(*batches[index % steps])
    current = [iter(loader)]

    def from_loader(index: int) -> None:
        try:
            x, y = next(current[0])
        except StopIteration:  # the epoch ended: a new one, as the next pass of a `for` loop starts it
            current[0] = iter(loader)
            x, y = next(current[0])
        step(x, y)

    return from_loader


def all_steps(step: Callable[[int], None], steps: int) -> Callable[[], None]:
    """A function running steps 0 .. steps-1 (warm-up and profiling)."""

    def run() -> None:
        for index in range(steps):
            step(index)

    return run


def no_op() -> None:
    pass


def alternate(
    steps: dict[str, Callable[[int], None]],
    per_round: int,
    rounds: int,
    around: dict[str, tuple[Callable[[], None], Callable[[], None]]] | None = None,
    cpu: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Per contender, one per-step time (s) per round: the median of `per_round` single steps, each timed alone.

    The contenders take turns step by step (in a fresh random order every step, `step_orders`), so every raw step
    has fabric's and Lightning's beside it under the same machine state; timing blocks of steps instead let the
    scheduler's phases fall on one contender's block (per-round ratios then spread from 0.99x to 1.22x).
    `around[name]`: two functions run right before and after each of that contender's steps, outside its time.
    `cpu`, when given, receives per contender the same medians of this thread's CPU time per step (the work a
    contender does, without its waits on other processes or for a core), read outside the wall-clock window.
    """
    clock, cpu_clock = time.perf_counter, time.thread_time
    samples: dict[str, list[float]] = {name: [] for name in steps}
    arounds = {name: (around or {}).get(name, (no_op, no_op)) for name in steps}
    for round_index in range(rounds):
        times: dict[str, list[float]] = {name: [] for name in steps}
        cpu_times: dict[str, list[float]] = {name: [] for name in steps}
        for index, order in enumerate(step_orders(list(steps), per_round, seed=round_index)):
            for name in order:
                before, after = arounds[name]
                before()
                cpu_start = cpu_clock()
                start = clock()
                steps[name](index)
                times[name].append(clock() - start)
                cpu_times[name].append(cpu_clock() - cpu_start)
                after()
        for name, values in times.items():
            samples[name].append(statistics.median(values))
            if cpu is not None:
                cpu.setdefault(name, []).append(statistics.median(cpu_times[name]))
    return samples


def worker(model_name: str, variant: str, rounds: int, frameworks: str, smoke: bool) -> None:
    """Runs in a fresh process: build every contender, warm up, interleave the rounds, print JSON."""
    import torch

    torch.set_num_threads(1)
    widths, batch, steps, blocks = (SMOKE_MODELS if smoke else MODELS)[model_name]
    step_fns = {fw: _build(fw, widths, batch, variant, steps) for fw in frameworks.split(",")}
    for step in step_fns.values():  # warm up: allocator, autograd graph caches, lazy imports
        for _ in range(1 if smoke else max(2, 300 // steps)):
            all_steps(step, steps)()
    emit({"samples": alternate(step_fns, steps * blocks, rounds), "threads": torch.get_num_threads()})


def importable_frameworks(peer_arg: str | None) -> list[str]:
    """raw, fabric and the peers this interpreter imports (all contenders share one process, so one interpreter);
    prints the machine line, and why a peer is left out."""
    rows = common_contenders(RAW, peer_arg)
    here = [fw for _, py, fw, _ in rows if py == sys.executable]
    for _, py, fw, _ in rows:
        if py != sys.executable and fw != "raw":
            print(f"skipped: {fw}: importable only by {py}; the contenders share one process (one interpreter)")
    return list(dict.fromkeys(here))


def report(
    title: str,
    samples: dict[str, list[float]],
    target: float,
    raw_label: str = RAW,
    labels: dict[str, str] | None = None,
) -> bool:
    """The table, then per contender its ratio band to raw and its per-step difference; whether fabric met target.
    `labels`: table labels of contenders other than the frameworks."""
    base = samples["raw"]
    labels = FRAMEWORK_LABELS | (labels or {}) | {"raw": raw_label}
    rows = [Row(labels[fw], s, None if fw == "raw" else base) for fw, s in samples.items()]
    print_table(title, rows, "us/step", 1e6)
    ok = True
    for fw, s in samples.items():
        if fw == "raw":
            continue
        met = print_ratio(f"{fw} / raw", s, base, target if fw == "fabric" else None)
        ok &= met or fw != "fabric"
        diffs = [a - b for a, b in zip(s, base, strict=True)]
        print(f"difference {fw} - raw: {statistics.median(diffs) * 1e6:+.1f} us/step (median of the rounds)")
    return ok


def profile(n_steps: int) -> None:
    """cProfile `n_steps` fabric steps of the tiny MLP; print the fabric-owned functions by cumulative time."""
    import cProfile
    import pstats

    widths, batch = MODELS["tiny"][:2]
    run = all_steps(_build("fabric", widths, batch, "tensors", n_steps), n_steps)
    run()  # warm
    prof = cProfile.Profile()
    prof.runcall(run)
    print_profile(pstats.Stats(prof), n_steps, "fabric steps (tiny MLP, 1 thread)")


def print_profile(stats: Any, n_steps: int, what: str) -> None:
    """The fabric-owned functions of a cProfile run, per step, by cumulative time."""
    from pathlib import Path

    import fabric

    root = str(Path(fabric.__file__).parent)
    own = [(k, v) for k, v in stats.stats.items() if k[0].startswith(root)]
    total = stats.total_tt
    self_time = sum(v[2] for _, v in own)
    print(f"cProfile, {n_steps} {what}: {total * 1e6 / n_steps:.1f} us/step profiled,")
    print(f"fabric-owned self time {self_time * 1e6 / n_steps:.2f} us/step ({self_time / total:.1%} of profiled)")
    print(f"{'function':<60} {'calls/step':>10} {'self us/step':>13} {'cum us/step':>12}")
    for (file, line, name), (_, ncalls, tt, ct, _) in sorted(own, key=lambda kv: -kv[1][3])[:15]:
        where = f"{Path(file).relative_to(Path(root).parent)}:{line}({name})"
        print(f"{where:<60} {ncalls / n_steps:>10.1f} {tt * 1e6 / n_steps:>13.2f} {ct * 1e6 / n_steps:>12.2f}")


def rounds_to_run(args: argparse.Namespace) -> int:
    """--rounds, raised to the reporting rule's minimum unless --smoke."""
    if args.smoke:
        return 2
    if args.rounds < MIN_ROUNDS:
        print(f"--rounds {args.rounds} raised to {MIN_ROUNDS}: fewer rounds cannot show a 2% band")
    return max(args.rounds, MIN_ROUNDS)


def parse(
    argv: Sequence[str] | None = None, more: Callable[[argparse.ArgumentParser], None] | None = None
) -> argparse.Namespace:
    """The options every step benchmark takes; `more` adds a script's own."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15, help=f"interleaved rounds (at least {MIN_ROUNDS})")
    parser.add_argument("--peer-python", help="accepted for run_all; peers run only if this interpreter has them")
    parser.add_argument("--profile", type=int, metavar="STEPS", help="only profile fabric on the tiny MLP")
    parser.add_argument("--smoke", action="store_true", help="2 short rounds of the tiny MLP: checks the code paths")
    parser.add_argument("--worker", nargs=4, metavar=("MODEL", "VARIANT", "ROUNDS", "FW"), help=argparse.SUPPRESS)
    if more is not None:
        more(parser)
    return parser.parse_args(argv)


def main() -> int:
    args = parse()
    if args.worker:
        model_name, variant, rounds, frameworks = args.worker
        worker(model_name, variant, int(rounds), frameworks, args.smoke)
        return 0
    if args.profile:
        profile(args.profile)
        return 0
    frameworks = importable_frameworks(args.peer_python)
    print(load_line())
    rounds = rounds_to_run(args)
    benches = [("tiny", "tensors")] if args.smoke else BENCHES
    exceeded = False
    # One process per contender, each building the models in another order (`build_orders`), rounds pooled.
    jobs = 1 if args.smoke else len(frameworks)
    per_job = rounds if args.smoke else -(-rounds // jobs)
    for model_name, variant in benches:

        def run_job(_job: int, order: list[str], model_name: str = model_name, variant: str = variant) -> Any:
            argv = [__file__, "--worker", model_name, variant, str(per_job), ",".join(order)]
            data, _ = run_json(sys.executable, [*argv, *(["--smoke"] if args.smoke else [])], env=THREAD_ENV)
            return data["samples"]

        samples = pooled_jobs(frameworks, jobs, run_job)
        widths, batch, steps, blocks = (SMOKE_MODELS if args.smoke else MODELS)[model_name]
        title = (
            f"{model_name} MLP {'->'.join(map(str, widths))}, batch {batch}, data from {variant}; "
            f"{f'{jobs} processes (each building the models in another order)' if jobs > 1 else '1 process'} x "
            f"{per_job} rounds x {blocks * steps} alternated steps, each timed alone, 1 thread"
        )
        met = report(title, samples, TARGET)
        exceeded |= model_name == "tiny" and not met
    if exceeded:
        print("\nhint: python benchmarks/step_overhead.py --profile 2000   shows where fabric's time goes")
    return 0


if __name__ == "__main__":
    sys.exit(main())

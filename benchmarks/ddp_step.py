"""DDP step time with 2 CPU processes over gloo: raw torch DDP, fabric's `ddp` and Lightning Fabric's, paired.

One 2-rank job (started as torchrun would: RANK, WORLD_SIZE, MASTER_ADDR, ... in the environment) holds every
contender: fabric sets up its model (creating the process group, as in a user's script), raw torch wraps its
own copy of the same model in DistributedDataParallel on that group, and Lightning Fabric (where this
interpreter imports it) sets up a third copy on it too. The contenders take turns step by step (the order flips
every step), each step timed alone on rank 0: each round gives one per-step time per contender (the median of its
steps), and the ratio to raw DDP is reported as the median and p25-p75 band of the per-round ratios: both sides of
each ratio ran in the same processes, moments apart.

Two things keep the noise of this machine (2 cores, 2 ranks, each with its gloo threads) out of the ratio:
- Each rank's threads are pinned to a core of their own (rank r on core r; `--no-pin` leaves them to the
  scheduler). Unpinned, each step's end is a race between the ranks' threads for the two cores, and a few
  hundred nanoseconds more or less of Python before `backward` decide who waits: one `sys._getframe()` call
  before `loss.backward()` moved the raw step by +25 to +34 us (2-3%) unpinned, and by nothing pinned.
- A second copy of raw DDP runs as a contender ("control"): its ratio to raw DDP is what two identical
  contenders differ by in this run, the floor under every other ratio.
- The tiny MLP runs TINY_ROUNDS_FACTOR times the rounds (a round of it takes about a second): with 9 rounds,
  the median ratio of one run moved by about 1% from run to run; with 61, by about 0.6%.
- The rounds are split over one job per contender, each building the contenders' models in another order (the
  one built first runs about 1% slower all job long), and pooled; a line per job shows its own ratios.

Under each table, the CPU time of rank 0's main thread per step (read around each timed step) gives what every
contender adds in work, without the waits on the other rank that make up most of the wall clock's noise: fabric's
layer is Python run on that thread, so it shows there in full.

`--same-model` measures fabric's layer alone: fabric sets up one model per job, and raw DDP and its control step
that very DDP module, optimizer and batches (fabric's forward guard set aside around their steps, outside their
time), so separately built models' memory layouts, which move a step by 1-2%, are out of the ratio. Peers cannot
share fabric's model and are left out.

`--components` (implies `--same-model`) adds three contenders that each make one of fabric's calls and the rest raw:
fabric's model call (its forward wrapper and guard), `fabric.backward` and the wrapped optimizer's `step`, so the
CPU lines show what each adds to a step (the issue's "profile every microsecond fabric adds per step"); a fourth
makes the model call through a wrapper without the forward guard, which tells the guard's share.

Run:  python benchmarks/ddp_step.py [--rounds 15] [--no-pin] [--jobs N] [--same-model | --components] [--model tiny]
      python benchmarks/ddp_step.py --profile 2000   # cProfile 2000 fabric DDP steps on rank 0
      python benchmarks/ddp_step.py --smoke          # a quick run of the code paths: no numbers to keep
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from _common import emit, load_line, pooled_jobs, print_ratio, ratio_band, run_two_ranks
from step_overhead import (
    all_steps,
    alternate,
    importable_frameworks,
    make_mlp,
    no_op,
    parse,
    print_profile,
    report,
    rounds_to_run,
)

# name -> (layer widths, batch size per rank, batches, batch cycles per round: steps per round = their product)
MODELS: dict[str, tuple[tuple[int, ...], int, int, int]] = {
    "tiny": ((32, 64, 64, 10), 32, 50, 4),
    "small": ((256, 1024, 1024, 256), 64, 10, 2),
}
TINY_ROUNDS_FACTOR = 5
SMOKE_MODELS: dict[str, tuple[tuple[int, ...], int, int, int]] = {"tiny": ((32, 64, 64, 10), 32, 5, 1)}
WORLD_SIZE = 2
TARGET = 1.02
# --components: one of fabric's calls in an otherwise raw step, to see what each adds (see _same_model_steps)
COMPONENTS = {
    "forward": "fabric's model call only",
    "unguarded": "the same without the guard",
    "backward": "fabric.backward only",
    "step": "fabric's step only",
}
WORKER_TIMEOUT_S = 300


def _build(framework: str, widths: tuple[int, ...], batch: int, steps: int, fabric: Any) -> Callable[[int], None]:
    """This rank's model, optimizer and data set up by `framework`; a function running step `index` of `steps`."""
    import torch

    torch.manual_seed(0)  # the same weights for every contender; DDP broadcasts rank 0's anyway
    model: Any = make_mlp(widths)
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = _batches(widths, batch, steps, int(os.environ["RANK"]))
    backward: Callable[[Any], None] = _plain_backward
    if framework in ("raw", "raw2"):
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    else:
        fab = fabric if framework == "fabric" else _peer_fabric(framework)
        model, optimizer = fab.setup(model, optimizer)
        backward = fab.backward
    torch.set_num_threads(1)  # a framework may have changed it during setup
    return _step(model, optimizer, backward, batches)


def _batches(widths: tuple[int, ...], batch: int, steps: int, rank: int) -> list[Any]:
    """`steps` (input, target) batches of this rank, the same for every contender."""
    import torch

    gen = torch.Generator().manual_seed(rank)
    xs = torch.randn(steps, batch, widths[0], generator=gen)
    return list(zip(xs, torch.randint(0, widths[-1], (steps, batch), generator=gen), strict=True))


def _plain_backward(loss: Any) -> None:
    loss.backward()


def _step(model: Any, optimizer: Any, backward: Callable[[Any], None], batches: list[Any]) -> Callable[[int], None]:
    """A training step on batch `index` (modulo their number): forward, loss, zero_grad, backward, step."""
    from torch.nn.functional import cross_entropy

    def step(index: int) -> None:
        x, y = batches[index % len(batches)]
        loss = cross_entropy(model(x), y)
        optimizer.zero_grad()
        backward(loss)
        optimizer.step()

    return step


def _same_model_steps(
    widths: tuple[int, ...], batch: int, steps: int, fabric: Any
) -> tuple[dict[str, Callable[[int], None]], dict[str, tuple[Callable[[], None], Callable[[], None]]]]:
    """`--same-model`: fabric sets up one model; raw DDP and its control step the very DDP module, optimizer and
    batches under fabric's wrappers, so nothing but fabric's layer differs (no memory layout of separately built
    models, which moves a step by 1-2%). Fabric's forward guard (a pre-hook on the user's module, see
    `fabric._forward_methods`) is set aside around each raw step, outside its time: raw DDP runs hook-free, as it
    does without fabric. Returns the steps and, per raw contender, what runs before and after each of its steps."""
    import torch

    from fabric.wrappers import _FabricModule

    torch.manual_seed(0)
    module = make_mlp(widths)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=1e-3))
    batches = _batches(widths, batch, steps, fabric.global_rank)
    torch.set_num_threads(1)
    inner_model, inner_optimizer = model._forward_module, optimizer.optimizer
    fns = {name: _step(inner_model, inner_optimizer, _plain_backward, batches) for name in ("raw", "raw2")}
    fns["fabric"] = _step(model, optimizer, fabric.backward, batches)
    # --components: fabric's model call, fabric.backward or fabric's step, each in an otherwise raw step
    fns["forward"] = _step(model, inner_optimizer, _plain_backward, batches)
    fns["backward"] = _step(inner_model, inner_optimizer, fabric.backward, batches)
    fns["step"] = _step(inner_model, optimizer, _plain_backward, batches)
    # fabric's model call as it would be without the forward guard (what the guard costs is "forward" minus this)
    unguarded = _FabricModule(inner_model, module, fabric.strategy.precision)
    fns["unguarded"] = _step(unguarded, inner_optimizer, _plain_backward, batches)
    guard = model._forward_guard  # None on one process: nothing to set aside
    # These call the DDP module without lifting the guard themselves: it is set aside around their steps.
    raw_forward = ("raw", "raw2", "unguarded", "backward", "step")
    set_aside = {} if guard is None else {name: (guard.lift, guard.drop) for name in raw_forward}
    return fns, set_aside


def _peer_fabric(framework: str) -> Any:
    """Lightning Fabric on the process group fabric created (it finds the group initialised and joins it)."""
    fab = __import__(framework).Fabric(accelerator="cpu", strategy="ddp", devices=WORLD_SIZE)
    fab.launch()
    return fab


def _pin_threads(rank: int) -> bool:
    """Every thread of this rank (gloo's and fabric's too) on core `rank`; threads started later inherit it.
    False where the machine has fewer cores than ranks, or no affinity call (not Linux)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < WORLD_SIZE:
        return False
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task.name), {cores[rank]})
    return True


def worker(
    model_name: str, rounds: int, frameworks: str, smoke: bool, profile_steps: int, pin: bool, same_model: bool
) -> NoReturn:
    """One rank: build every contender, warm up, interleave the rounds; rank 0 prints the samples as JSON. Ends the
    process (see the end)."""
    import faulthandler

    import torch
    import torch.distributed as dist

    from fabric import Fabric

    # A rank that hangs (a lost peer, a stuck shutdown) prints where, for the error message, and exits.
    faulthandler.dump_traceback_later(WORKER_TIMEOUT_S, exit=True)
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=WORLD_SIZE)
    fabric.launch()  # creates the process group, as a user's script does
    pinned = pin and _pin_threads(fabric.global_rank)  # after launch: gloo's threads exist now
    widths, batch, steps, blocks = (SMOKE_MODELS if smoke else MODELS)[model_name]
    names = ["fabric"] if profile_steps else frameworks.split(",")
    around: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {}
    if same_model:
        all_fns, around = _same_model_steps(widths, batch, steps, fabric)
        step_fns = {name: all_fns[name] for name in names}
    else:
        step_fns = {fw: _build(fw, widths, batch, profile_steps or steps, fabric) for fw in names}
    runs = {fw: all_steps(step, profile_steps or steps) for fw, step in step_fns.items()}
    warm_up(runs, around, 1 if smoke else max(2, 100 // steps))
    if profile_steps:
        _profile(runs["fabric"], profile_steps)
    else:
        dist.barrier()
        cpu: dict[str, list[float]] = {}
        samples = alternate(step_fns, steps * blocks, rounds, around, cpu)
        if dist.get_rank() == 0:
            job = {"world_size": dist.get_world_size(), "backend": dist.get_backend(), "pinned": pinned}
            job["guard_warned"] = "unwrapped-forward" in fabric._warn_once._given  # see _same_model_steps
            emit({"samples": samples, "cpu": cpu, **job})
    dist.barrier()
    leave()


def warm_up(runs: dict[str, Callable[[], None]], around: dict[str, Any], repeats: int) -> None:
    """Each contender's run `repeats` times, between its `around` pair: the allocator, DDP's bucket rebuild after
    the first step and lazy imports out of the timed rounds."""
    for name, run in runs.items():
        before, after = around.get(name, (no_op, no_op))
        for _ in range(repeats):
            before()
            run()
            after()


def leave() -> NoReturn:
    """Destroy the process group and end the process.

    Leave without freeing the models: freeing the last DDP model after the group is gone frees gloo's process
    group, whose destructor joins gloo's worker thread while holding the GIL, and that thread may still be
    freeing the barrier's work, whose thread-local state needs the GIL: a deadlock inside torch (native stacks
    seen with py-spy; about 1 run in 15 with the ranks pinned, which makes the window wider).
    """
    import torch.distributed as dist

    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _profile(run: Callable[[], None], steps: int) -> None:
    import cProfile
    import pstats

    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() != 0:
        run()
        return
    prof = cProfile.Profile()
    prof.runcall(run)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_profile(pstats.Stats(prof), steps, "fabric DDP steps on rank 0 (tiny MLP, 2 gloo ranks, 1 thread)")
    emit({"profile": text.getvalue()})


def _run_jobs(
    argv: Callable[[list[str]], list[str]], names: list[str], jobs: int, same_model: bool = False
) -> tuple[dict[str, list[float]], dict[str, list[float]], bool]:
    """Run the 2-rank job `jobs` times, job j building the contenders in `names` rotated by j (one model for all
    with `same_model`); their rounds pooled per contender (in `names` order): the wall-clock samples, the CPU-time
    samples of rank 0's main thread, and whether every job pinned its ranks. With several jobs, a line per job
    gives its median ratios to raw DDP."""
    pinned = True
    cpu: dict[str, list[float]] = {name: [] for name in names}

    def run_job(job: int, order: list[str]) -> dict[str, list[float]]:
        nonlocal pinned
        data = run_two_ranks(argv(order), {}, timeout=WORKER_TIMEOUT_S + 60)
        assert data["world_size"] == WORLD_SIZE, data
        if data.get("guard_warned"):
            raise RuntimeError(
                "--same-model: a raw DDP step reached fabric's forward guard (it warned), so raw DDP ran with a "
                "hook on its module, slower than without fabric: the ratios of this run are void."
            )
        pinned &= bool(data.get("pinned"))
        for name in names:
            cpu[name].extend(data["cpu"][name])
        if jobs > 1:
            base = data["samples"]["raw"]
            ratios = ", ".join(f"{name} {ratio_band(data['samples'][name], base)[0]:.3f}x" for name in names[1:])
            built = "" if same_model else f" (built first: {order[0]})"
            print(f"job {job + 1} of {jobs}{built}: median ratio to raw DDP: {ratios}")
        return data["samples"]

    pooled = pooled_jobs(names, jobs, run_job)
    return pooled, cpu, pinned


def _report_cpu(cpu: dict[str, list[float]]) -> None:
    """Each contender's CPU time per step next to raw DDP's: the work it adds, without the waits on the other
    rank that make up most of the wall-clock noise (fabric's layer is Python frames: CPU, never a wait)."""
    print(f"CPU time of rank 0's main thread per step, raw DDP: {statistics.median(cpu['raw']) * 1e6:.1f} us")
    print_cpu_differences(cpu)


def print_cpu_differences(cpu: dict[str, list[float]]) -> None:
    """Per contender after raw, its CPU-time ratio band to raw and the median and p25-p75 of its per-round
    differences."""
    base = cpu["raw"]
    for name in list(cpu)[1:]:
        print_ratio(f"{name} / raw, CPU", cpu[name], base)
        diffs = sorted((a - b) * 1e6 for a, b in zip(cpu[name], base, strict=True))
        low, high = statistics.quantiles(diffs, n=4)[0::2] if len(diffs) > 1 else (diffs[0], diffs[0])
        print(f"CPU difference {name} - raw: {statistics.median(diffs):+.1f} us/step (p25-p75 {low:+.1f} to "
              f"{high:+.1f}, median of the rounds)")  # fmt: skip


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _worker_argv(args: argparse.Namespace, model_name: str, rounds: int, order: list[str]) -> list[str]:
    """One rank's command line: the model, its rounds, the contenders in the order it builds them, the options."""
    options = [
        *(["--smoke"] if args.smoke else []),
        *(["--no-pin"] if args.no_pin else []),
        *(["--same-model"] if args.same_model else []),
    ]
    return [__file__, "--worker", model_name, "-", str(rounds), ",".join(order), *options]


def _title(model_name: str, smoke: bool, jobs: int, rounds: int, pinned: bool, same_model: bool = False) -> str:
    """The table's title: the model, how the rounds were run, and whether every rank was pinned to a core."""
    widths, batch, steps, blocks = (SMOKE_MODELS if smoke else MODELS)[model_name]
    if same_model:
        how = " (one model per job: raw DDP steps the DDP module, optimizer and batches fabric set up)"
    else:
        how = " (each building the models in another order)" if jobs > 1 else ""
    return (
        f"DDP, {WORLD_SIZE} CPU processes (gloo), {model_name} MLP {'->'.join(map(str, widths))}, batch {batch}"
        f"/rank; {_plural(jobs, 'job')}{how} x "
        f"{rounds} rounds x {blocks * steps} alternated steps, each timed on "
        f"rank 0, 1 thread/rank, {'each rank pinned to a core' if pinned else 'ranks not pinned to cores'}"
    )


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-pin", action="store_true", help="leave the ranks' threads to the scheduler")
    parser.add_argument(
        "--jobs", type=int, default=None, help="jobs the rounds are split over (default: one per contender)"
    )
    parser.add_argument(
        "--same-model",
        action="store_true",
        help="raw DDP steps the DDP module, optimizer and batches fabric set up (no peers): fabric's layer alone",
    )
    parser.add_argument("--model", choices=list(MODELS), action="append", help="only this MLP (default: all)")
    parser.add_argument(
        "--components",
        action="store_true",
        help="--same-model, plus one contender per call fabric adds to a step (model call, backward, step)",
    )


def main() -> int:
    args = parse(more=_options)
    if args.worker:
        model_name, _, rounds, frameworks = args.worker
        worker(model_name, int(rounds), frameworks, args.smoke, args.profile or 0, not args.no_pin, args.same_model)
    if args.profile:
        profiled = [__file__, "--worker", "tiny", "-", "1", "fabric", "--profile", str(args.profile)]
        print(run_two_ranks(profiled, {"MKL_NUM_THREADS": "1"}, timeout=WORKER_TIMEOUT_S + 60).get("profile", ""))
        return 0
    frameworks = importable_frameworks(args.peer_python)
    frameworks.insert(frameworks.index("raw") + 1, "raw2")  # the control: raw DDP against itself
    args.same_model |= args.components
    if args.same_model:
        for peer in frameworks[3:]:
            print(f"skipped: {peer}: --same-model steps one model that fabric set up; a peer cannot share it")
        frameworks = ["raw", "raw2", "fabric", *(COMPONENTS if args.components else ())]
    print(load_line())
    base_rounds = rounds_to_run(args)
    for model_name in SMOKE_MODELS if args.smoke else args.model or MODELS:
        jobs = args.jobs or (1 if args.smoke else len(frameworks))
        factor = TINY_ROUNDS_FACTOR if model_name == "tiny" else 1
        # The small MLP: at least half the rounds per job (its per-round ratios spread by several percent).
        rounds = base_rounds if args.smoke else max(-(-base_rounds * factor // jobs), -(-base_rounds // 2))
        argv = functools.partial(_worker_argv, args, model_name, rounds)
        samples, cpu, pinned = _run_jobs(argv, frameworks, jobs, args.same_model)
        title = _title(model_name, args.smoke, jobs, rounds, pinned, args.same_model)
        report(title, samples, TARGET, raw_label="raw DDP", labels=COMPONENTS)
        _report_cpu(cpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())

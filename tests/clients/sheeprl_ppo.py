"""sheeprl's PPO on fabric after an import rewrite only, checked against the same run on Lightning Fabric.

A standalone script for CI (not a pytest test), run in an environment that has sheeprl 0.8.4, lightning,
gymnasium and this checkout's fabric installed:

    python tests/clients/sheeprl_ppo.py --workdir DIR

It copies the installed sheeprl package to DIR/src/sheeprl, rewrites its imports as a user porting it would
(`REWRITE_RULES`, nothing else), then runs PPO on CartPole-v1 with one and with two CPU processes, each once on
the rewritten copy (fabric) and once on the installed package (Lightning). It exits non-zero, naming what
differed, unless every run succeeds, writes one Hydra run directory and one logger directory, and the fabric
runs' TensorBoard scalars and final checkpoints equal Lightning's exactly: both run the same float32 operations
in the same order on the same CPU, so any difference, however small, is a behaviour difference.
"""

from __future__ import annotations

import argparse
import compileall
import importlib.metadata
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]

# The whole port, as `sed -E` expressions would write it (docs/migrating/lightning_fabric.md quotes them): a regular
# expression and its replacement per rule.
REWRITE_RULES: tuple[tuple[str, str], ...] = (
    (r"from lightning import Fabric", "from fabric import Fabric"),
    (r"lightning[._]fabric", "fabric"),  # both `lightning.fabric` and the standalone `lightning_fabric`
)
REWRITTEN_SUFFIXES = (".py", ".yaml")

# PPO on CartPole, as short as still meaningful: per process 2 environments x 32 steps per update, 256 policy
# steps in all (8 updates on one process, 4 on two), 2 epochs of minibatches of 32 per update, metrics logged at
# every update (`make_runs`), the last checkpoint saved at the end, then one test episode. `disable_timer` drops the
# wall-clock throughput metrics, the only scalars that cannot be equal between two runs.
SHEEPRL_OVERRIDES = (
    "exp=ppo",
    "env=gym",
    "env.id=CartPole-v1",
    "env.num_envs=2",
    "env.capture_video=False",
    "algo.rollout_steps=32",
    "algo.total_steps=256",
    "algo.per_rank_batch_size=32",
    "algo.update_epochs=2",
    "metric.disable_timer=True",
    "checkpoint.every=256",
    "checkpoint.save_last=True",
    "fabric.accelerator=cpu",
    "seed=7",
    "run_name=ppo",
    # A time-stamped run directory: a child process that computed its own instead of reusing the parent's
    # would create a second one.
    "hydra.run.dir=hydra_${now:%H-%M-%S_%f}",
)


_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                       "MASTER_", "TORCHELASTIC_", "SLURM_", "LSB_", "JSM_", "OMPI_", "PMI_")  # fmt: skip
PINNED = ("sheeprl", "lightning", "torch", "gymnasium", "hydra-core", "tensorboard")


@dataclass
class Run:
    name: str
    backend: str  # "fabric" or "lightning"
    devices: int
    cwd: Path
    command: list[str]
    env: dict[str, str]
    seconds: float = 0.0
    returncode: int | None = None


class Failures:
    """Every check's failure message, so that one run reports all that differed."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def check(self, ok: bool, message: str) -> bool:
        if not ok:
            self.messages.append(message)
        return ok


def rewrite_source(text: str) -> tuple[str, int]:
    """`text` with `REWRITE_RULES` applied, and the number of its lines that changed."""
    lines = text.splitlines(keepends=True)
    changed = 0
    for index, line in enumerate(lines):
        new = line
        for pattern, replacement in REWRITE_RULES:
            new = re.sub(pattern, replacement, new)
        if new != line:
            lines[index] = new
            changed += 1
    return "".join(lines), changed


def copy_and_rewrite(package_dir: Path, destination: Path) -> int:
    """Copy the package to `destination` and rewrite its imports; return the number of lines rewritten."""
    if destination.exists():
        shutil.rmtree(destination)
    shutil.copytree(package_dir, destination, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    total = 0
    for path in sorted(destination.rglob("*")):
        if path.suffix not in REWRITTEN_SUFFIXES or not path.is_file():
            continue
        text, changed = rewrite_source(path.read_text(encoding="utf-8"))
        if changed:
            path.write_text(text, encoding="utf-8")
            total += changed
    return total


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def installed_sheeprl() -> Path:
    """The installed sheeprl package's folder, found without importing it (an import would import lightning)."""
    spec = importlib.util.find_spec("sheeprl")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("sheeprl is not installed in this environment: pip install sheeprl==0.8.4")
    return Path(next(iter(spec.submodule_search_locations)))


def sheeprl_command() -> list[str]:
    """sheeprl's console command, run by this interpreter: the launchers start the children from its argv."""
    script = Path(sys.executable).parent / "sheeprl"
    if not script.is_file():
        sys.exit(f"sheeprl's console script {script} is missing: reinstall sheeprl in this environment")
    return [sys.executable, str(script)]


def make_runs(workdir: Path, src: Path) -> list[Run]:
    # A plain machine for both: no variables of a scheduler or launcher that CI itself may run under.
    base_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith(_LAUNCHER_VARIABLES)}
    base_env["PYTHONHASHSEED"] = "0"
    inherited = os.environ.get("PYTHONPATH", "")
    # The rewritten copy first, so `import sheeprl` finds it, then this checkout, so the fabric under test is
    # this one even where the environment has another installed.
    fabric_path = os.pathsep.join(p for p in (str(src), str(REPO_ROOT), inherited) if p)
    runs = []
    for devices in (1, 2):
        for backend in ("fabric", "lightning"):
            name = f"{backend}-{devices}p"
            env = dict(base_env)
            if backend == "fabric":
                env["PYTHONPATH"] = fabric_path
            elif inherited:
                env["PYTHONPATH"] = inherited
            # Metrics logged at every update: one update is 64 policy steps per process.
            command = [
                *sheeprl_command(),
                *SHEEPRL_OVERRIDES,
                f"fabric.devices={devices}",
                f"metric.log_every={64 * devices}",
            ]
            runs.append(Run(name, backend, devices, workdir / name, command, env))
    return runs


def check_imports(run: Run, src: Path, failures: Failures) -> None:
    """The fabric run imports the rewritten sheeprl and this checkout's fabric (found without importing them)."""
    code = "import importlib.util as u; print(u.find_spec('sheeprl').origin); print(u.find_spec('fabric').origin)"
    found = subprocess.run([sys.executable, "-c", code], env=run.env, capture_output=True, text=True, check=True)
    sheeprl_origin, fabric_origin = (Path(line) for line in found.stdout.split())
    print(f"{run.name} imports {sheeprl_origin.parent} and {fabric_origin.parent}")
    failures.check(
        sheeprl_origin.is_relative_to(src) and fabric_origin.is_relative_to(REPO_ROOT / "fabric"),
        f"{run.name} would import sheeprl from {sheeprl_origin} and fabric from {fabric_origin}, "
        f"expected {src} and {REPO_ROOT / 'fabric'}",
    )


def start(run: Run) -> tuple[subprocess.Popen, float]:
    if run.cwd.exists():
        shutil.rmtree(run.cwd)
    run.cwd.mkdir(parents=True)
    log = (run.cwd / "output.txt").open("w")
    # A session of its own, so that a run that hangs is ended with all its processes (`execute`).
    process = subprocess.Popen(
        run.command, cwd=run.cwd, env=run.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    log.close()
    return process, time.perf_counter()


def execute(runs: list[Run], jobs: int, timeout: float) -> None:
    """Run `runs`, `jobs` at a time, recording each one's exit status and wall time; end one after `timeout`s."""
    pending = list(runs)
    active: list[tuple[Run, subprocess.Popen, float]] = []
    while pending or active:
        while pending and len(active) < jobs:
            run = pending.pop(0)
            active.append((run, *start(run)))
        for entry in list(active):
            run, process, started = entry
            if process.poll() is None and time.perf_counter() - started > timeout:
                print(f"{run.name}: still running after {timeout:.0f}s, ending it", flush=True)
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            if process.poll() is not None:
                run.returncode = process.returncode
                run.seconds = time.perf_counter() - started
                active.remove(entry)
        time.sleep(0.05)


def tail(path: Path, lines: int = 25) -> str:
    return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])


def logger_versions(run: Run) -> list[Path]:
    return sorted(run.cwd.glob("logs/runs/ppo/CartPole-v1/ppo/version_*"))


def check_layout(run: Run, failures: Failures) -> None:
    """One Hydra run directory, one TensorBoard version folder with one event file (rank 0's)."""
    hydra_dirs = sorted(run.cwd.glob("hydra_*"))
    failures.check(
        len(hydra_dirs) == 1,
        f"{run.name}: {len(hydra_dirs)} Hydra run directories ({', '.join(p.name for p in hydra_dirs)}), expected 1"
        + (": a child process did not reuse the parent's hydra.run.dir" if hydra_dirs else ""),
    )
    versions = logger_versions(run)
    events = sorted(run.cwd.glob("logs/**/events.out.tfevents.*"))
    failures.check(
        [v.name for v in versions] == ["version_0"] and len(events) == 1,
        f"{run.name}: logger output {[str(p.relative_to(run.cwd)) for p in [*versions, *events]]}, expected only "
        "version_0 with one event file: a rank other than 0 wrote logger output",
    )
    config = next(iter(versions), run.cwd).joinpath("config.yaml")
    if run.backend == "fabric" and failures.check(config.is_file(), f"{run.name}: no {config}"):
        text = config.read_text()
        failures.check(
            "lightning.fabric" not in text and "_target_: fabric.Fabric" in text,
            f"{run.name}: {config} does not show fabric.Fabric as the Fabric class: the rewrite did not apply",
        )


def read_scalars(run: Run) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(run.cwd.glob("logs/**/events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return scalars


def compare_scalars(ours: Run, theirs: Run, failures: Failures) -> tuple[int, float]:
    """Tag by tag and step by step; returns the number of values compared and the largest difference."""
    mine, reference = read_scalars(ours), read_scalars(theirs)
    failures.check(bool(reference), f"{theirs.name}: no scalars logged")
    if not failures.check(
        set(mine) == set(reference),
        f"{ours.name} vs {theirs.name}: scalar tags differ: only in fabric {sorted(set(mine) - set(reference))}, "
        f"only in Lightning {sorted(set(reference) - set(mine))}",
    ):
        return 0, float("nan")
    compared, worst = 0, 0.0
    for tag in sorted(reference):
        steps_mine, steps_ref = [s for s, _ in mine[tag]], [s for s, _ in reference[tag]]
        if not failures.check(
            steps_mine == steps_ref, f"{ours.name}: {tag} logged at steps {steps_mine}, Lightning at {steps_ref}"
        ):
            continue
        for (step, value), (_, expected) in zip(mine[tag], reference[tag], strict=True):
            compared += 1
            worst = max(worst, abs(value - expected))
            failures.check(value == expected, f"{ours.name}: {tag} at step {step} is {value}, Lightning's {expected}")
    return compared, worst


def flatten(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from flatten(value, f"{prefix}/{key}")
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from flatten(value, f"{prefix}/{index}")
    else:
        yield prefix, obj


def checkpoint_of(run: Run) -> Path | None:
    found = sorted(run.cwd.glob("logs/runs/ppo/CartPole-v1/ppo/version_0/checkpoint/*.ckpt"))
    return found[-1] if found else None


def compare_checkpoints(ours: Run, theirs: Run, failures: Failures) -> tuple[int, float]:
    import torch

    paths = checkpoint_of(ours), checkpoint_of(theirs)
    if not failures.check(all(paths), f"{ours.name} / {theirs.name}: final checkpoint missing: {paths}"):
        return 0, float("nan")
    if not failures.check(
        paths[0].name == paths[1].name, f"{ours.name}: checkpoint {paths[0].name}, Lightning's {paths[1].name}"
    ):
        return 0, float("nan")
    mine, reference = (dict(flatten(torch.load(p, map_location="cpu", weights_only=False))) for p in paths)
    if not failures.check(
        set(mine) == set(reference),
        f"{ours.name}: checkpoint keys differ: only in fabric {sorted(set(mine) - set(reference))[:5]}, "
        f"only in Lightning {sorted(set(reference) - set(mine))[:5]}",
    ):
        return 0, float("nan")
    compared, worst = 0, 0.0
    for key, expected in reference.items():
        value = mine[key]
        if isinstance(expected, torch.Tensor):
            same_kind = (
                isinstance(value, torch.Tensor) and value.shape == expected.shape and value.dtype == expected.dtype
            )
            if not failures.check(same_kind, f"{ours.name}: checkpoint {key} is {value!r:.80}, Lightning's a tensor"):
                continue
            compared += 1
            if expected.numel():
                worst = max(worst, (value.double() - expected.double()).abs().max().item())
            failures.check(
                torch.equal(value, expected), f"{ours.name}: checkpoint tensor {key} differs from Lightning's"
            )
        else:
            failures.check(value == expected, f"{ours.name}: checkpoint {key} is {value!r}, Lightning's {expected!r}")
    return compared, worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True, help="where the copy, the runs and their logs go")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1: faster on 2 cores)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds before a run is ended (default 300)")
    args = parser.parse_args(argv)
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)

    print("versions:", ", ".join(f"{name} {_version(name)}" for name in PINNED))
    src = workdir / "src"
    rewritten = copy_and_rewrite(installed_sheeprl(), src / "sheeprl")
    # Byte-compiled now, as the installed package is, so that the first fabric run's time is not the compiler's.
    compileall.compile_dir(src, quiet=1)
    print(f"sheeprl copied to {src / 'sheeprl'}: {rewritten} lines rewritten by {len(REWRITE_RULES)} rules")
    for pattern, replacement in REWRITE_RULES:
        print(f"  s/{pattern}/{replacement}/")

    runs = make_runs(workdir, src)
    failures = Failures()
    check_imports(runs[0], src, failures)
    started = time.perf_counter()
    execute(runs, args.jobs, args.timeout)
    total = time.perf_counter() - started

    by_name = {run.name: run for run in runs}
    rows = []
    for run in runs:
        print(f"{run.name}: exit {run.returncode} in {run.seconds:.1f}s: cd {run.cwd} && {' '.join(run.command)}")
        if failures.check(run.returncode == 0, f"{run.name} exited with {run.returncode}"):
            check_layout(run, failures)
        else:
            print(f"--- last lines of {run.cwd / 'output.txt'} ---\n{tail(run.cwd / 'output.txt')}")
    for run in runs:
        reference = by_name[f"lightning-{run.devices}p"]
        scalars: tuple[int, float] | None = None
        checkpoint: tuple[int, float] | None = None
        if run.backend == "fabric" and run.returncode == 0 and reference.returncode == 0:
            scalars = compare_scalars(run, reference, failures)
            checkpoint = compare_checkpoints(run, reference, failures)
        rows.append((run, scalars, checkpoint))

    print(f"\n{'run':<14}{'wall s':>8}{'scalars':>9}{'max diff':>10}{'tensors':>9}{'max diff':>10}")
    for run, scalars, checkpoint in rows:
        compared = "".join(
            f"{'(ref)':>9}{'':>10}" if run.backend == "lightning" else f"{'-':>9}{'-':>10}" if found is None
            else f"{found[0]:>9}{found[1]:>10.3g}"
            for found in (scalars, checkpoint)
        )  # fmt: skip
        print(f"{run.name:<14}{run.seconds:>8.1f}{compared}")
    print(f"all runs: {total:.1f}s with {args.jobs} at a time")

    if failures.messages:
        shown = failures.messages[:20]
        more = [f"... and {len(failures.messages) - len(shown)} more"] if len(failures.messages) > len(shown) else []
        print(f"\nFAILED: {len(failures.messages)} problem(s):", *shown, *more, sep="\n  ", file=sys.stderr)
        return 1
    print("OK: fabric's runs equal Lightning's exactly (scalars and checkpoint tensors), one Hydra directory each")
    return 0


if __name__ == "__main__":
    sys.exit(main())

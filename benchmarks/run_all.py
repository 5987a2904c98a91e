"""Run every CPU benchmark one after another (and, with --cuda, the GPU ones), printing all their tables.

The scripts run one at a time, never side by side: two benchmarks sharing the cores would measure each other.
Each gets the same --peer-python (or $FABRIC_BENCH_PEER_PYTHON) so every table has the Lightning Fabric and
Accelerate rows where that interpreter has them. --tee writes everything printed to a file as well.
At the end the tables are drawn (matplotlib): one panel per table, each contender's ratio to raw PyTorch
with raw PyTorch's own spread as the noise band, into docs/img/benchmarks.png or --chart PATH.

Run:  python benchmarks/run_all.py [--rounds 5] [--peer-python PYTHON] [--cuda] [--tee results.txt]
      python benchmarks/run_all.py --smoke --chart /tmp/b.png   # each new script's --smoke mode: no numbers
      python benchmarks/run_all.py --chart-from results.txt      # redraw from a --tee file, runs nothing
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import time
from pathlib import Path
from typing import TextIO

HERE = Path(__file__).resolve().parent
DEFAULT_CHART = HERE.parent / "docs" / "img" / "benchmarks.png"


def plan(args: argparse.Namespace) -> list[list[str]]:
    """The argument lists, one per script, in the order they run."""
    if args.smoke:
        cpu = [["launch_startup.py", "--smoke"], ["checkpoint.py", "--smoke"], ["checkpoint_async.py", "--smoke"]]
        cpu.append(["uneven_all_gather.py", "--smoke"])
        cpu.append(["collectives.py", "--smoke"])
        cpu.append(["collective_record_overhead.py", "--smoke"])
        cpu.append(["loader_state.py", "--smoke"])
        cpu.append(["fork_after_async.py", "--smoke"])
        cpu.append(["loader_overhead.py", "--smoke"])
        cpu.append(["log_overhead.py", "--smoke"])
        cpu += [["step_overhead.py", "--smoke"], ["ddp_step.py", "--smoke"], ["pipeline_bubble.py", "--smoke"]]
        cpu.append(["ddp_layer.py", "--smoke"])
        gpu = [
            ["cuda_precision.py", "--device", "cpu", "--smoke"],
            ["gpu_memory_and_speed.py", "--device", "cpu", "--smoke"],
        ]
        return [*cpu, *gpu]
    peer = ["--peer-python", args.peer_python] if args.peer_python else []
    rounds = ["--rounds", str(args.rounds)]
    scripts = [
        ["import_time.py", "-n", str(3 * args.rounds), *peer],
        ["step_overhead.py", *rounds, *peer],
        ["ddp_step.py", *rounds, *peer],
        ["ddp_layer.py"],  # no peer can step fabric's model; 40 rounds by default, about 3 minutes
        ["launch_startup.py", *rounds, *peer],
        ["checkpoint.py", *rounds, *peer],
        ["checkpoint_async.py", *rounds, *peer],
        ["fork_after_async.py", *rounds, *peer],
        ["collectives.py", "--rounds", str(max(args.rounds, 9)), *peer],  # issue 21's rule: >= 9 rounds
        ["uneven_all_gather.py", *rounds, *peer],
        ["collective_record_overhead.py", *rounds, *peer],
        ["loader_state.py", *peer],  # repetitions, not rounds: --reps (default 200)
        ["loader_overhead.py", "--rounds", str(max(args.rounds, 9)), *peer],
        ["log_overhead.py", "--rounds", str(max(args.rounds, 9)), *peer],
        # No peer: neither Lightning Fabric nor Accelerate pipelines a training step; it reports against theory.
        ["pipeline_bubble.py", "--steps", str(max(5, args.rounds))],
    ]
    if args.cuda:
        scripts.append(["cuda_precision.py", "--rounds", str(max(1, args.rounds // 2 + 1)), *peer])
        scripts.append(["gpu_memory_and_speed.py", *peer])
    return scripts


def run(script: list[str], out: list[TextIO]) -> int:
    """Run one script, copying its output line by line to every stream in `out`; its exit status."""
    header = f"\n=== python benchmarks/{' '.join(script)}  ({time.strftime('%Y-%m-%d %H:%M:%S')})"
    for stream in out:
        print(header, file=stream, flush=True)
    proc = subprocess.Popen(
        [sys.executable, str(HERE / script[0]), *script[1:]],
        cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        for stream in out:
            stream.write(line)
            stream.flush()
    return proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="rounds per script (import_time: 3x as many runs)")
    parser.add_argument("--peer-python", help="interpreter with lightning-fabric and accelerate installed")
    parser.add_argument(
        "--cuda", action="store_true", help="also run cuda_precision.py and gpu_memory_and_speed.py (GPUs)"
    )
    parser.add_argument("--smoke", action="store_true", help="only the new scripts' quick --smoke modes")
    parser.add_argument("--tee", type=Path, help="also write everything to this file")
    parser.add_argument(
        "--chart", type=Path, help=f"draw the tables into this image (default: {DEFAULT_CHART}; --smoke: none)"
    )
    parser.add_argument("--no-chart", action="store_true", help="do not draw the tables")
    parser.add_argument("--chart-from", type=Path, help="run nothing; draw the tables of a --tee file")
    args = parser.parse_args()
    chart = None if args.no_chart else args.chart or (None if args.smoke else DEFAULT_CHART)
    if args.chart_from:
        return draw_chart(args.chart_from.read_text(), chart or DEFAULT_CHART)

    captured = io.StringIO()
    out: list[TextIO] = [sys.stdout, captured]
    tee = args.tee.open("w") if args.tee else None
    if tee:
        out.append(tee)
    failed = []
    try:
        for script in plan(args):
            code = run(script, out)
            if code != 0:
                failed.append(f"{script[0]} (exit {code})")
    finally:
        if tee:
            tee.close()
    if chart is not None:
        draw_chart(captured.getvalue(), chart)
    if failed:
        print(f"\nrun_all: these scripts failed: {', '.join(failed)}; their output is above.", file=sys.stderr)
        return 1
    return 0


def draw_chart(output: str, path: Path) -> int:
    """Draw the tables found in the scripts' output into `path`; 0, or 1 when there was nothing to draw."""
    # Loaded by path, like the scripts load _common: benchmarks/ is not a package.
    sys.path.insert(0, str(HERE))
    import _chart

    tables = _chart.parse_tables(output)
    machine = next((line for line in output.splitlines() if line.startswith("machine: ")), "")
    # The CPU and core count; the load average differs per script and is in each panel's title.
    subtitle = machine.removeprefix("machine: ").split(" | ")[0].split(", load avg")[0]
    try:
        _chart.draw(tables, path, subtitle)
    except ValueError as error:
        print(f"run_all: no chart drawn: {error}", file=sys.stderr)
        return 1
    print(f"run_all: chart of {len(tables)} tables written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

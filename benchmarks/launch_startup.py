"""Launcher start-up: time from starting a command until both of its 2 CPU ranks have finished training step 1.

Each contender runs `_startup_worker.py` (a tiny DDP model, one step, over gloo) with 2 processes:
  raw torchrun / spawn / fork      torchrun, or torch.multiprocessing.start_processes, around a raw script
  fabric ddp / ddp_spawn / ddp_fork  fabric's own launchers (re-run the script / spawn / fork)
  fabric under torchrun           the fabric script started by torchrun (processes exist, no fabric launcher)
  fabric run CLI                  `python -m fabric run --devices 2`, which builds the torchrun command
and, with --peer-python, Lightning Fabric's launchers and Lightning Fabric and Accelerate under torchrun.
Each rank writes time.time() after its first step; the caller took time.time() just before starting the
command. Reported: start -> slowest rank done with step 1, and start -> command exited. Each launcher is
compared with its raw equivalent run by the same interpreter: ddp and torchrun rows with raw torchrun,
ddp_spawn with raw spawn, ddp_fork with raw fork. Contenders run round-robin for several rounds.

Run:  python benchmarks/launch_startup.py [--rounds 5] [--peer-python /path/to/bench-venv/bin/python]
      python benchmarks/launch_startup.py --smoke      # 1 round of raw fork vs fabric ddp_fork: does it run?
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import HERE, Row, machine_line, median_iqr, peer_python, plan_contenders, print_table

WORKER = str(HERE / "_startup_worker.py")
WORLD_SIZE = 2
TIMEOUT_S = 180
# Variables that would make a launched script believe it already runs inside a job.
JOB_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")
# (label, framework, how, raw baseline's how). `how` as _startup_worker.py takes it; "cli" is `fabric run`.
LAUNCHERS = {
    "raw": [("raw torchrun", "torchrun"), ("raw spawn", "spawn"), ("raw fork", "fork")],
    "fabric": [("ddp", "torchrun"), ("ddp_spawn", "spawn"), ("ddp_fork", "fork"), ("torchrun", "torchrun")],
    "lightning_fabric": [("ddp", "torchrun"), ("ddp_spawn", "spawn"), ("ddp_fork", "fork"), ("torchrun", "torchrun")],
    "accelerate": [("torchrun", "torchrun")],
}
SMOKE = ("raw fork", "fabric ddp_fork")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def command(python: str, framework: str, how: str, outdir: str) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment that start one contender's 2 ranks."""
    port = str(_free_port())
    torchrun = [python, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(WORLD_SIZE)]
    torchrun += ["--master-port", port]
    if how == "cli":
        cli = [python, "-m", "fabric", "run", "--accelerator", "cpu", "--devices", str(WORLD_SIZE)]
        return [*cli, "--main-port", port, WORKER, "fabric", "torchrun", outdir], {}
    if how == "torchrun":
        return [*torchrun, WORKER, framework, how, outdir], {}
    if framework == "raw":  # torch.multiprocessing needs the rendezvous address from the script's environment
        return [python, WORKER, framework, how, outdir], {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    return [python, WORKER, framework, how, outdir], {}  # the library picks its own free port


def launch_once(python: str, framework: str, how: str) -> dict[str, float]:
    """Start the command, wait for it; seconds from start to every rank's step 1, to exit, and to imports done."""
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES and not k.startswith("TORCHELASTIC_")}
    env |= {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory(prefix="fabric-startup-") as outdir:
        argv, extra = command(python, framework, how, outdir)
        start = time.time()
        proc = subprocess.Popen(
            argv, cwd=HERE, env=env | extra, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,  # so a hung launch can be ended with all its children
        )  # fmt: skip
        try:
            output, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        exited = time.time()
        ranks = [json.loads(p.read_text()) for p in sorted(Path(outdir).glob("rank*.json"))]
    if proc.returncode != 0 or len(ranks) != WORLD_SIZE:
        raise RuntimeError(
            f"{' '.join(argv)} exited with {proc.returncode} after {exited - start:.1f} s and {len(ranks)} of "
            f"{WORLD_SIZE} ranks recorded step 1; output tail:\n{output[-2000:]}"
        )
    return {
        "step1": max(r["step1"] for r in ranks) - start,
        "exit": exited - start,
        "imported": max(r["imported"] for r in ranks) - start,
    }


def plan(peer_arg: str | None) -> list[tuple[str, str, str, str, str]]:
    """Print machine line and skips; return (label, python, framework, how, baseline label) per contender."""
    frameworks, versions, skipped = plan_contenders(peer_python(peer_arg))
    print(machine_line(versions))
    for reason in skipped:
        print(f"skipped: {reason}")
    rows: list[tuple[str, str, str, str, str]] = []
    for interp in dict.fromkeys([sys.executable, *frameworks.values()]):
        tag = "" if interp == sys.executable else " (peer)"
        rows += [(f"{label}{tag}", interp, "raw", how, f"{label}{tag}") for label, how in LAUNCHERS["raw"]]
        for fw in (fw for fw, py in frameworks.items() if py == interp):
            for how, raw_how in LAUNCHERS[fw]:
                base = f"raw {raw_how}{tag}"
                name = f"{fw} under torchrun" if how == "torchrun" else f"{fw} {how}"
                rows.append((f"{name}{tag}", interp, fw, how, base))
                if fw == "fabric" and how == "torchrun":
                    rows.append((f"fabric run CLI{tag}", interp, fw, "cli", base))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="round-robin rounds (one launch per contender each)")
    parser.add_argument("--peer-python", help="interpreter with lightning-fabric and accelerate installed")
    parser.add_argument("--smoke", action="store_true", help=f"1 round of {' and '.join(SMOKE)} only, no peers")
    args = parser.parse_args()
    if args.smoke:
        args.rounds = 1
        os.environ.pop("FABRIC_BENCH_PEER_PYTHON", None)

    contenders = plan(None if args.smoke else args.peer_python)
    if args.smoke:
        contenders = [c for c in contenders if c[0] in SMOKE]
    samples: dict[str, dict[str, list[float]]] = {c[0]: {"step1": [], "exit": [], "imported": []} for c in contenders}
    for r in range(args.rounds):
        k = r % len(contenders)
        for label, py, fw, how, _ in contenders[k:] + contenders[:k]:
            for key, value in launch_once(py, fw, how).items():
                samples[label][key].append(value)

    for key, what in (("step1", "every rank finished step 1"), ("exit", "the command exited")):
        rows = []
        for label, _, _, _, base in contenders:
            note = f"imports done at {median_iqr(samples[label]['imported'])[0] * 1e3:.0f} ms" if key == "step1" else ""
            rows.append(Row(label, samples[label][key], None if base == label else samples[base][key], note))
        title = f"Launch start-up, {WORLD_SIZE} CPU ranks (gloo): start -> {what}; {args.rounds} rounds"
        print_table(title, rows, "ms", 1e3)
    return 0


if __name__ == "__main__":
    sys.exit(main())

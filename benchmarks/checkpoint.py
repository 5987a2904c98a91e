"""Checkpoint save and load: time and peak memory of `fabric.save`/`fabric.load` against plain torch.save/torch.load.

The state is a model of about --size-mb MB of float32 parameters (square Linear layers) with AdamW after one
step, so the checkpoint holds about 3x that (weights, exp_avg, exp_avg_sq). Every measurement is a fresh process:
build model and optimizer, reset the peak-RSS counter (Linux /proc/self/clear_refs), then time one save, or one
load into a freshly built model and optimizer (the resume case). Memory is the peak resident set size during the
operation minus the resident size just before it: what the operation itself needed on top of the live state.
Contenders (all into one temporary directory, each its own file):
  raw torch           torch.save({'model': sd, 'optimizer': sd, 'step': 1}, path) / torch.load + load_state_dict
  raw torch + fsync   the same save followed by flush and os.fsync, as fabric's atomic save does (reference)
  fabric              fabric.save(path, {'model': model, 'optimizer': optimizer, 'step': 1}) / fabric.load
and, with --peer-python, Lightning Fabric's save/load and Accelerate's save_state/load_state (a directory;
the model as safetensors). Ratios compare with raw torch in the same interpreter. Contenders run round-robin;
in every round each contender saves, then loads what it saved (so the file is in the page cache for all alike).

Run:  python benchmarks/checkpoint.py [--rounds 5] [--size-mb 300] [--dir /tmp] [--peer-python PYTHON]
      python benchmarks/checkpoint.py --smoke     # 1 round, 16 MB, raw torch and fabric: does it run?
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import Row, check_target, emit, print_table, run_json
from _common import contenders as common_contenders

WIDTH = 2048  # one Linear(WIDTH, WIDTH) holds 16.8 MB of float32 weights and bias
TARGET = 1.05
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _rss_kb(field: str) -> int:
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, in kB."""
    with Path("/proc/self/status").open() as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak() -> bool:
    """Make VmHWM start again from the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _state(size_mb: float) -> tuple[Any, Any]:
    """A model of about `size_mb` MB of float32 parameters and an AdamW that has taken one step."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    per_layer = (WIDTH * WIDTH + WIDTH) * 4 / 2**20
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(max(1, round(size_mb / per_layer)))))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer


def _take_step(model: Any, optimizer: Any) -> None:
    import torch

    model(torch.randn(4, WIDTH)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # gradients are not part of a checkpoint; free them


def _operation(framework: str, op: str, path: str, model: Any, optimizer: Any) -> Any:
    """Set up with `framework`; return a function doing the timed save or load."""
    import torch

    if framework in ("raw", "raw_fsync"):

        def raw_save() -> None:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 1}
            if framework == "raw":
                torch.save(state, path)
                return
            with Path(path).open("wb") as handle:  # durable on disk before returning, like fabric's save
                torch.save(state, handle)
                handle.flush()
                os.fsync(handle.fileno())

        def raw_load() -> None:
            checkpoint = torch.load(path, map_location="cpu")
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])

        return raw_save if op == "save" else raw_load
    if framework == "accelerate":
        from accelerate import Accelerator

        acc = Accelerator(cpu=True)
        model, optimizer = acc.prepare(model, optimizer)
        return (lambda: acc.save_state(path)) if op == "save" else (lambda: acc.load_state(path))
    fab = __import__(framework).Fabric(accelerator="cpu", devices=1)
    model, optimizer = fab.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 1}
    return (lambda: fab.save(path, state)) if op == "save" else (lambda: fab.load(path, state))


def _measure(framework: str, op: str, path: str, size_mb: float) -> dict[str, Any]:
    """Build the state, then time one save or load of it and record the peak RSS it added."""
    model, optimizer = _state(size_mb)
    if op == "save":
        _take_step(model, optimizer)
    run = _operation(framework, op, path, model, optimizer)
    resettable = _reset_peak()
    before = _rss_kb("VmRSS")
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    peak = _rss_kb("VmHWM")
    n_params = sum(p.numel() for p in model.parameters())
    return {"seconds": seconds, "extra_mb": (peak - before) / 1024, "peak_mb": peak / 1024, "reset": resettable,
            "param_mb": n_params * 4 / 2**20}  # fmt: skip


def worker(framework: str, ops: str, path: str, size_mb: float) -> None:
    """Runs in a fresh process: measure each of the comma-separated `ops` in turn; print the results as JSON."""
    import torch

    torch.set_num_threads(1)
    emit({op: _measure(framework, op, path, size_mb) for op in ops.split(",")})


def _size_on_disk(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="round-robin rounds (fresh processes each)")
    parser.add_argument("--size-mb", type=float, default=300, help="float32 parameter MB (checkpoint ~3x)")
    parser.add_argument("--dir", help="where the checkpoints go (default: the system temporary directory)")
    parser.add_argument("--peer-python", help="interpreter with lightning-fabric and accelerate installed")
    parser.add_argument("--smoke", action="store_true", help="1 round, 16 MB, raw torch and fabric only")
    parser.add_argument("--worker", nargs=4, metavar=("FRAMEWORK", "OPS", "PATH", "MB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        framework, ops, path, size = args.worker
        worker(framework, ops, path, float(size))
        return 0
    if args.smoke:
        args.rounds, args.size_mb = 1, 16
        os.environ.pop("FABRIC_BENCH_PEER_PYTHON", None)

    contenders = common_contenders("raw torch", None if args.smoke else args.peer_python)
    contenders.insert(1, ("raw torch + fsync", sys.executable, "raw_fsync", "raw torch"))
    if args.smoke:
        contenders = [c for c in contenders if c[2] in ("raw", "fabric")]
    tmp = Path(tempfile.mkdtemp(prefix="fabric-ckpt-bench-", dir=args.dir))
    samples: dict[tuple[str, str, str], list[float]] = {
        (c[0], op, key): [] for c in contenders for op in ("save", "load") for key in ("seconds", "extra_mb")
    }
    info: dict[str, Any] = {}
    try:
        for r in range(args.rounds):
            k = r % len(contenders)
            for label, py, fw, _ in contenders[k:] + contenders[:k]:
                path = tmp / label.replace(" ", "_")
                # A fresh process per operation; --smoke saves and loads in one, to stay quick.
                for ops in ["save,load"] if args.smoke else ["save", "load"]:
                    data, _ = run_json(py, [__file__, "--worker", fw, ops, str(path), str(args.size_mb)], THREAD_ENV)
                    for op, result in data.items():
                        for key in ("seconds", "extra_mb"):
                            samples[(label, op, key)].append(result[key])
                        info[label] = (result["param_mb"], _size_on_disk(path), result["reset"])
        how = "save and load in one process (--smoke)" if args.smoke else "a fresh process per operation"
        _report(contenders, samples, info, f"{args.rounds} rounds, {how}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _report(contenders: list, samples: dict, info: dict[str, Any], runs: str) -> None:
    param_mb, disk_mb, reset = info[contenders[0][0]]
    print(f"\nstate: {param_mb:.0f} MB float32 parameters + AdamW state; raw torch checkpoint {disk_mb:.0f} MB on disk")
    if not reset:
        print("note: /proc/self/clear_refs was not writable: peak memory includes building the state")
    for op in ("save", "load"):
        for key, unit, scale, what in (("seconds", "ms", 1e3, "time"), ("extra_mb", "MB", 1.0, "peak RSS increase")):
            rows = []
            for label, _, _, base in contenders:
                base_samples = None if label == base else samples[(base, op, key)]
                note = f"{info[label][1]:.0f} MB on disk" if key == "seconds" and op == "save" else ""
                rows.append(Row(label, samples[(label, op, key)], base_samples, note))
            print_table(f"Checkpoint {op}: {what}, {runs}", rows, unit, scale)
    if any(c[2] == "fabric" for c in contenders):
        for op in ("save", "load"):
            check_target(f"fabric.{op} vs torch.{op}", samples[("fabric", op, "seconds")],
                         samples[("raw torch", op, "seconds")], TARGET)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

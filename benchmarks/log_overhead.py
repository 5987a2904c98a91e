"""What logging a step's metrics costs: `fabric.log_dict` with a CSVLogger, next to a raw CSV writer and Lightning's.

One process without a process group (the single-device case, where rank detection falls back to the environment).
Each call logs a scalar tensor and a float at a new step; the loggers buffer rows and write them every 100 calls
(their default), and the raw contender does the same by hand: `.item()`, a row appended to a list, `csv.DictWriter`
every 100 rows. Each round times --calls calls per contender, in `round_order`; the per-round ratio to raw gives the
band. A second table times one call of a `rank_zero_only` function (what every rank-zero logger method pays).

Run:  python benchmarks/log_overhead.py [--rounds 9]
      python benchmarks/log_overhead.py --smoke     # 2 rounds, few calls: does it run?
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from _common import MIN_ROUNDS, Row, contenders, load_line, print_ratio, print_table, round_order

FLUSH_EVERY = 100


class _RawCSV:
    """A user's own buffered CSV log: what the loggers do, without a framework."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._rows: list[dict[str, float]] = []
        self._header_written = False

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row = {key: value.item() if hasattr(value, "item") else value for key, value in metrics.items()}
        row["step"] = step
        self._rows.append(row)
        if len(self._rows) >= FLUSH_EVERY:
            with self._path.open("a", newline="") as file:
                writer = csv.DictWriter(file, fieldnames=list(self._rows[0]))
                if not self._header_written:
                    writer.writeheader()
                    self._header_written = True
                writer.writerows(self._rows)
            self._rows.clear()


def _log_calls(root: Path, peer: bool) -> tuple[dict[str, Callable[[int], None]], dict[str, Callable[[], Any]]]:
    """Per contender, a function logging one step's metrics, and a `rank_zero_only` function to call."""
    import torch

    from fabric import Fabric
    from fabric.loggers import CSVLogger
    from fabric.utilities.rank_zero import rank_zero_only

    loss = torch.tensor(0.25)
    raw = _RawCSV(root / "raw.csv")
    fab = Fabric(accelerator="cpu", devices=1, loggers=CSVLogger(root / "fabric", flush_logs_every_n_steps=FLUSH_EVERY))
    logs: dict[str, Callable[[int], None]] = {
        "raw csv": lambda step: raw.log({"loss": loss, "acc": 0.5}, step),
        "fabric": lambda step: fab.log_dict({"loss": loss, "acc": 0.5}, step=step),
    }
    rank_zero: dict[str, Callable[[], Any]] = {"raw call": lambda: None, "fabric": rank_zero_only(lambda: None)}
    if not peer:
        return logs, rank_zero
    try:
        from lightning_fabric import Fabric as LightningFabric
        from lightning_fabric.loggers import CSVLogger as LightningCSVLogger
        from lightning_fabric.utilities.rank_zero import rank_zero_only as lightning_rank_zero_only
    except ImportError:
        print("skipped: lightning_fabric: not importable here")
        return logs, rank_zero
    logger = LightningCSVLogger(root / "lightning", flush_logs_every_n_steps=FLUSH_EVERY)
    light = LightningFabric(accelerator="cpu", devices=1, loggers=logger)
    logs["lightning_fabric"] = lambda step: light.log_dict({"loss": loss, "acc": 0.5}, step=step)
    rank_zero["lightning_fabric"] = lightning_rank_zero_only(lambda: None)
    return logs, rank_zero


def _per_call(fn: Callable[[int], Any], calls: int, first_step: int) -> float:
    start = time.perf_counter()
    for step in range(first_step, first_step + calls):
        fn(step)
    return (time.perf_counter() - start) / calls


def _rounds(contenders: Mapping[str, Callable[[int], Any]], rounds: int, calls: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for index in range(rounds):
        for name in round_order(list(contenders), index):
            samples[name].append(_per_call(contenders[name], calls, index * calls))
    return samples


def _report(title: str, samples: dict[str, list[float]], baseline: str) -> None:
    names = list(samples)
    base = samples[baseline]
    print_table(title, [Row(name, samples[name], None if name == baseline else base) for name in names], "us", 1e6)
    for name in names[1:]:
        print_ratio(f"{name} / {baseline}", samples[name], base)
        added = statistics.median(s - b for s, b in zip(samples[name], base, strict=True)) * 1e6
        print(f"{name}: {added:+.2f} us per call (median of per-round differences)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS, help=f"interleaved rounds (at least {MIN_ROUNDS})")
    parser.add_argument("--calls", type=int, default=2000, help="calls per contender and round")
    parser.add_argument("--peer-python", help=argparse.SUPPRESS)  # run_all passes it; the peer runs in-process here
    parser.add_argument("--smoke", action="store_true", help="2 rounds, few calls")
    args = parser.parse_args()
    rounds = 2 if args.smoke else max(args.rounds, MIN_ROUNDS)
    calls = 50 if args.smoke else args.calls
    contenders("raw csv", None)  # prints the machine line
    print(load_line())
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        logs, rank_zero = _log_calls(Path(root), peer=True)
        for fn in logs.values():
            _per_call(fn, FLUSH_EVERY, 0)  # warm-up: the files, the first flush, lazy imports
        samples = _rounds(logs, rounds, calls)
        _report(f"log_dict of a tensor and a float, CSV written every {FLUSH_EVERY} calls: {rounds} rounds x "
                f"{calls} calls", samples, "raw csv")  # fmt: skip
        calls_of = {name: (lambda _step, fn=fn: fn()) for name, fn in rank_zero.items()}
        _report(f"one call of a rank_zero_only function: {rounds} rounds x {calls} calls",
                _rounds(calls_of, rounds, calls), "raw call")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Shared helpers for the benchmark scripts: statistics, fresh-subprocess runs, peer lookup, result tables."""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
MARKER = "BENCH_JSON "
PEER_ENV = "FABRIC_BENCH_PEER_PYTHON"
# Import names of the libraries compared.
FRAMEWORKS = ("fabric", "lightning_fabric", "accelerate")


@dataclass
class Row:
    """One line of a result table: a contender's samples and the samples of its raw-PyTorch baseline."""

    label: str
    samples: list[float]
    baseline: list[float] | None = None
    note: str = ""


def median_iqr(values: Sequence[float]) -> tuple[float, float]:
    """Median and inter-quartile range (q3 - q1) of `values`."""
    if len(values) < 2:
        return (values[0], 0.0) if values else (float("nan"), 0.0)
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return statistics.median(values), q3 - q1


def emit(payload: dict) -> None:
    """Print `payload` as the JSON line that `run_json` picks out of a worker's stdout."""
    print(MARKER + json.dumps(payload), flush=True)


def run_json(
    python: str, args: Sequence[str], env: dict[str, str] | None = None, timeout: float = 900
) -> tuple[dict, float]:
    """Run `python *args` in a fresh process; return its last JSON line and the process wall time (s)."""
    start = time.perf_counter()
    proc = subprocess.run(
        [python, *args],
        capture_output=True,
        text=True,
        cwd=HERE,
        env={**os.environ, **(env or {})},
        timeout=timeout,
        check=False,
    )
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"{python} {' '.join(args)[:200]} exited with {proc.returncode}; stderr tail:\n{proc.stderr[-2000:]}"
        )
    return json.loads(lines[-1][len(MARKER) :]), wall


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a process group's store."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_two_ranks(args: Sequence[str], env: dict[str, str], timeout: float) -> dict:
    """Run `python *args` as ranks 0 and 1 of a 2-process job, started as torchrun would start them (RANK and
    friends, a free port); return rank 0's JSON line. Rank 1's output is discarded."""
    job = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    job |= {"GROUP_RANK": "0", "OMP_NUM_THREADS": "1", **env}
    other = subprocess.Popen(
        [sys.executable, *args],
        cwd=HERE,
        env={**os.environ, **job, "RANK": "1", "LOCAL_RANK": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        data, _ = run_json(sys.executable, args, env={**job, "RANK": "0", "LOCAL_RANK": "0"}, timeout=timeout)
    finally:
        try:
            other.wait(timeout=60)
        except subprocess.TimeoutExpired:
            other.kill()
            other.wait()
    return data


def peer_python(arg: str | None) -> str | None:
    """The interpreter that has the peers installed: --peer-python, else $FABRIC_BENCH_PEER_PYTHON, else None."""
    return arg or os.environ.get(PEER_ENV) or None


# Versions from the installed metadata, without importing torch: a probe costs a fraction of a second.
PROBE = (
    "import importlib.metadata as md, importlib.util as u, json\n"
    "def v(m, *ds):\n"
    "    if not u.find_spec(m): return None\n"
    "    for d in ds:\n"
    "        try: return md.version(d)\n"
    "        except Exception: pass\n"
    "    return '?'\n"
    "print('{marker}' + json.dumps({{'torch': md.version('torch'), 'python': '.'.join(map(str, __import__('sys')"
    ".version_info[:3])), 'fabric': v('fabric', 'torchfabric'), 'lightning_fabric': v('lightning_fabric', "
    "'lightning-fabric', 'lightning'), 'accelerate': v('accelerate', 'accelerate')}}))"
)


def probe(python: str) -> dict[str, str | None]:
    """Versions of python, torch and each framework importable by `python` (None: not importable)."""
    # -I: the repository checkout must not shadow what the interpreter itself has installed.
    data, _ = run_json(python, ["-I", "-c", PROBE.format(marker=MARKER)])
    return data


def plan_contenders(peer: str | None) -> tuple[dict[str, str], dict[str, dict], list[str]]:
    """Which framework runs under which interpreter; the interpreters' versions; why others are skipped."""
    interpreters = {"current": sys.executable}
    if peer:
        interpreters["peer"] = peer
    versions = {name: probe(py) for name, py in interpreters.items()}
    chosen: dict[str, str] = {}
    skipped: list[str] = []
    for fw in FRAMEWORKS:
        # Our library is only measured in our interpreter; peers prefer the peer interpreter.
        order = ["current"] if fw == "fabric" else ["peer", "current"]
        where = next((i for i in order if i in versions and versions[i].get(fw)), None)
        if where:
            chosen[fw] = where
        elif fw == "fabric":
            skipped.append("fabric: not importable by the current interpreter (pip install -e . first)")
        elif not peer:
            skipped.append(f"{fw}: not importable here and no --peer-python / ${PEER_ENV} given")
        else:
            skipped.append(f"{fw}: not importable by {peer} (nor by the current interpreter)")
    return {fw: interpreters[i] for fw, i in chosen.items()}, versions, skipped


def machine_line(versions: dict[str, dict]) -> str:
    """One line: CPU, cores, OS, and per interpreter its python/torch/framework versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with Path("/proc/cpuinfo").open() as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    parts = [f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, load avg {load:.2f}"]
    for name, v in versions.items():
        libs = ", ".join(f"{k} {v[k]}" for k in FRAMEWORKS if v.get(k))
        parts.append(f"{name} python {v['python']}: torch {v['torch']}" + (f", {libs}" if libs else ""))
    return "machine: " + " | ".join(parts) + f" | fabric source {_source_revision()}"


def _source_revision() -> str:
    """The checkout's commit, '+dirty' when fabric/ has uncommitted changes (an editable install runs those)."""
    git = ["git", "-C", str(HERE.parent)]
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run([*git, "status", "--porcelain", "--", "fabric"], capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def p10(values: Sequence[float]) -> float:
    """10th percentile: on a shared machine, the samples least disturbed by other processes."""
    # inclusive: interpolate between samples; the default extrapolates past them (negative times for 2 samples).
    return statistics.quantiles(values, n=10, method="inclusive")[0] if len(values) >= 2 else values[0]


def _vs(value: float, base: float) -> str:
    r = value / base
    return f"{r:.3f}x ({(r - 1) * 100:+.1f}%)"


def print_table(title: str, rows: Sequence[Row], unit: str, scale: float = 1.0) -> None:
    """Print median, IQR and 10th percentile, and their ratios to each row's baseline (raw, same interpreter)."""
    print(f"\n{title}")
    header = (
        f"{'contender':<38} {'median ' + unit:>14} {'IQR':>8} {'p10':>10} {'n':>4} "
        f"{'median vs base':>17} {'p10 vs base':>17}  note"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        med, iqr = median_iqr(row.samples)
        low = p10(row.samples)
        ratios = ("", "")
        if row.baseline:
            ratios = (_vs(med, median_iqr(row.baseline)[0]), _vs(low, p10(row.baseline)))
        print(
            f"{row.label:<38} {med * scale:>14.1f} {iqr * scale:>8.1f} {low * scale:>10.1f} {len(row.samples):>4} "
            f"{ratios[0]:>17} {ratios[1]:>17}  {row.note}"
        )


def check_target(what: str, samples: Sequence[float], baseline: Sequence[float], target: float) -> bool:
    """Print whether the median ratio is under `target` (p10 ratio alongside, as a low-noise check)."""
    ratio = median_iqr(samples)[0] / median_iqr(baseline)[0]
    low = p10(samples) / p10(baseline)
    verdict = "PASS" if ratio < target else "FAIL"
    print(f"target: {what} < {target:.2f}x -> median {ratio:.3f}x, p10 {low:.3f}x: {verdict} (judged on the median)")
    return ratio < target


def contenders(baseline: str, peer_arg: str | None) -> list[tuple[str, str, str, str]]:
    """Print the machine line and skips; return (label, python, framework, baseline label) per contender.

    The raw baseline runs once per interpreter in use, so each framework is compared with raw PyTorch
    measured by its own interpreter.
    """
    frameworks, versions, skipped = plan_contenders(peer_python(peer_arg))
    print(machine_line(versions))
    for reason in skipped:
        print(f"skipped: {reason}")
    rows: list[tuple[str, str, str, str]] = []
    for interp in dict.fromkeys([sys.executable, *frameworks.values()]):
        suffix = "" if interp == sys.executable else " (peer)"
        rows.append((baseline + suffix, interp, "raw", baseline + suffix))
        rows += [(f"{fw}{suffix}", interp, fw, baseline + suffix) for fw, py in frameworks.items() if py == interp]
    return rows


# The issue-21 reporting rule: at least this many interleaved rounds (alternating order), medians, and the p25-p75
# band of the per-round ratio, so a reader can tell a difference from the noise.
MIN_ROUNDS = 9


def round_order(names: Sequence[str], round_index: int) -> list[str]:
    """Contenders in the order round `round_index` runs them: reversed every other round, rotated every second.

    Rotating each round and reversing every other one would give two contenders the same order in every round
    (a rotation by one and a reversal cancel out); this way each takes each place equally often.
    """
    names = list(names)
    shift = (round_index // 2) % len(names)
    order = names[shift:] + names[:shift]
    return order[::-1] if round_index % 2 else order


def build_orders(names: Sequence[str], jobs: int) -> list[list[str]]:
    """The order each of `jobs` processes builds the contenders in: `names` rotated by the job's index.

    Within one process the contender built first ran about 1% slower for the whole run (three copies of raw DDP
    built in turn: 1.000, 0.994 and 0.990x), so a benchmark that always built raw torch first flattered every other
    contender. With one job per contender, each is built first once, and the pooled rounds carry no such bias.
    """
    return [[*names[job % len(names) :], *names[: job % len(names)]] for job in range(jobs)]


def pooled_jobs(
    names: Sequence[str], jobs: int, run_job: Callable[[int, list[str]], Mapping[str, list[float]]]
) -> dict[str, list[float]]:
    """Call `run_job(j, order)` for each of `jobs` jobs, job j building the contenders in `build_orders`' order j;
    return each contender's samples from all jobs, pooled (`run_job` returns contender -> samples)."""
    pooled: dict[str, list[float]] = {name: [] for name in names}
    for job, order in enumerate(build_orders(names, jobs)):
        samples = run_job(job, order)
        for name in names:
            pooled[name].extend(samples[name])
    return pooled


def step_orders(names: Sequence[str], count: int, seed: int = 0) -> list[list[str]]:
    """`count` orders of the contenders for interleaved steps: each a random permutation (seeded: runs repeat).

    Each contender then runs equally often in each place and right after each other contender. `round_order`'s
    cycle of 8 orders did the first only: with 4 contenders, raw DDP ran right after Lightning Fabric in 4 of every
    8 steps and the control (a second raw DDP) never did, and the control came out about 1% faster than raw.
    """
    rng = random.Random(seed)
    return [rng.sample(list(names), len(names)) for _ in range(count)]


def ratio_band(samples: Sequence[float], baseline: Sequence[float]) -> tuple[float, float, float]:
    """Median, p25 and p75 of the per-round ratios samples[i] / baseline[i] (the rounds are paired)."""
    ratios = [s / b for s, b in zip(samples, baseline, strict=True) if b > 0]
    if len(ratios) < 2:
        return (ratios[0], ratios[0], ratios[0]) if ratios else (float("nan"),) * 3
    q1, q2, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return q2, q1, q3


def print_ratio(label: str, samples: Sequence[float], baseline: Sequence[float], target: float | None = None) -> bool:
    """One line: `label: 1.012x (p25-p75 0.998-1.024x, n=9)`, with a verdict when `target` is given.

    A band that straddles 1.0 means the difference is inside the noise of this machine at this load.
    """
    med, low, high = ratio_band(samples, baseline)
    noise = " (inside the noise)" if low <= 1.0 <= high else ""
    line = f"ratio {label}: {med:.3f}x (p25-p75 {low:.3f}-{high:.3f}x, n={len(samples)}){noise}"
    ok = True
    if target is not None:
        ok = med <= target
        line += f" target <= {target:.2f}x: {'PASS' if ok else 'FAIL'}"
    print(line)
    return ok


def load_line() -> str:
    """`load avg 0.42 at start`, for the top of a report."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"load avg {load:.2f} at start"

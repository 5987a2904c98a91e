"""The benchmark scripts still run and print their tables (their quick --smoke modes; no timing is asserted)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
# A table row with a ratio to its baseline, e.g. "fabric   412.0   3.1   400.2   1   1.020x (+2.0%) ..."
RATIO_ROW = r"^{label}\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+\d+\s+[\d.]+x \([+-][\d.]+%\)"
_JOB_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in _JOB_VARIABLES and k != "FABRIC_BENCH_PEER_PYTHON"}
    return subprocess.run(
        [sys.executable, *args], cwd=BENCHMARKS, env=clean | (env or {}), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def _assert_ratio_row(output: str, label: str) -> None:
    assert re.search(RATIO_ROW.format(label=re.escape(label)), output, re.MULTILINE), output


@pytest.mark.multiprocess
def test_launch_startup_smoke_times_both_launchers() -> None:
    result = _run("launch_startup.py", "--smoke")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.startswith("machine: ")
    assert "start -> every rank finished step 1" in out and "start -> the command exited" in out
    assert re.search(r"^raw fork\s+[\d.]+", out, re.MULTILINE), out
    _assert_ratio_row(out, "fabric ddp_fork")


@pytest.mark.multiprocess
def test_checkpoint_smoke_measures_save_and_load() -> None:
    result = _run("checkpoint.py", "--smoke")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for title in ("save: time", "save: peak RSS increase", "load: time", "load: peak RSS increase"):
        assert f"Checkpoint {title}" in out, out
    _assert_ratio_row(out, "fabric")
    assert re.search(r"target: fabric\.save vs torch\.save < 1\.05x -> median [\d.]+x", out), out
    assert re.search(r"target: fabric\.load vs torch\.load < 1\.05x -> median [\d.]+x", out), out


@pytest.mark.multiprocess
def test_checkpoint_async_smoke_measures_blocking_and_sync_saves() -> None:
    result = _run("checkpoint_async.py", "--smoke")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "Synchronous save: time" in out and "Time fabric.save blocks the loop" in out, out
    for label in ("fabric sync", "fabric async, first save", "fabric async, later saves"):
        _assert_ratio_row(out, label)
    assert re.search(r"target: fabric\.save \(sync\) vs torch\.save \+ fsync < 1\.10x -> median [\d.]+x", out), out
    assert re.search(r"target: async fabric\.save blocking \(later saves\) vs sync fabric\.save < 0\.10x", out), out


@pytest.mark.multiprocess
def test_cuda_precision_code_paths_run_on_cpu() -> None:
    result = _run("cuda_precision.py", "--device", "cpu", "--smoke")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bf16-mixed on cpu" in result.stdout
    _assert_ratio_row(result.stdout, "fabric")


def test_cuda_precision_without_gpu_says_so() -> None:
    # An empty CUDA_VISIBLE_DEVICES hides every GPU, so this holds on a GPU machine too.
    result = _run("cuda_precision.py", env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert result.returncode == 1
    assert "cuda_precision.py: no CUDA GPU is visible" in result.stderr
    assert "pass --device cpu --smoke to check the code paths on the CPU" in result.stderr


def test_run_all_runs_every_benchmark_script() -> None:
    spec = importlib.util.spec_from_file_location("run_all", BENCHMARKS / "run_all.py")
    assert spec is not None and spec.loader is not None
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    parser_defaults = {"rounds": 2, "peer_python": "/peer/python", "cuda": True, "smoke": False}
    planned = run_all.plan(type("Args", (), parser_defaults)())
    scripts = {p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_") and p.name != "run_all.py"}
    assert {s[0] for s in planned} == scripts
    assert all(s[-2:] == ["--peer-python", "/peer/python"] for s in planned)

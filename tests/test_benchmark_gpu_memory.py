"""benchmarks/gpu_memory_and_speed.py still runs (its --smoke mode on 2 CPU processes; no number is asserted)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
_JOB_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in _JOB_VARIABLES} | {"OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "gpu_memory_and_speed.py", *args],
        cwd=BENCHMARKS,
        env=clean | (env or {}),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.multiprocess
def test_smoke_prints_the_memory_and_speed_tables() -> None:
    result = _run("--device", "cpu", "--smoke")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.startswith("machine: ")
    assert "Peak memory per rank, MB (torch.cuda.max_memory_allocated), 32-true, AdamW, 2 processes:" in out
    for strategy in ("ddp", "fsdp", "deepspeed stage 3"):
        assert re.search(rf"^{strategy}\s+n/a \(cpu\)\s+n/a \(cpu\)$", out, re.MULTILINE), out
    assert "bf16 step time on cpu, rank 0 of 2" in out
    assert re.search(r"^raw DDP \+ autocast bf16\s+[\d.]+", out, re.MULTILINE), out
    ratio = r"^fabric ddp bf16-mixed\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+\d+\s+[\d.]+x \([+-][\d.]+%\)"
    assert re.search(ratio, out, re.MULTILINE), out


def test_without_gpu_it_says_so() -> None:
    # An empty CUDA_VISIBLE_DEVICES hides every GPU, so this holds on a GPU machine too.
    result = _run(env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert result.returncode == 1
    assert "gpu_memory_and_speed.py: no CUDA GPU is visible" in result.stderr
    assert "pass --device cpu --smoke to check the code paths on the CPU" in result.stderr

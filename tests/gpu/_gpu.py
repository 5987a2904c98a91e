"""Helpers of the GPU suite: skipping with the reason where too few GPUs are visible, and running scripts.

Multi-GPU tests run scripts from tests/gpu/scripts (and tests/integration/scripts) in their own processes, like
the CPU integration tests; the single-GPU tests run in the pytest process. Run it all on a GPU machine with
`python -m pytest -q tests/gpu` (see docs/gpu_testing.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

GPU_SCRIPTS = Path(__file__).parent / "scripts"
INTEGRATION_SCRIPTS = Path(__file__).parents[1] / "integration" / "scripts"
if str(INTEGRATION_SCRIPTS) not in sys.path:
    sys.path.insert(0, str(INTEGRATION_SCRIPTS))

import _it_runner as runner  # noqa: E402  (needs the path above)


def visible_gpus() -> int:
    """GPUs this process can see, counted through NVML: it does not initialise CUDA, so forking stays safe."""
    return torch.cuda.device_count()


def needs_gpus(count: int) -> pytest.MarkDecorator:
    """Skip a test, saying how many GPUs are missing, where fewer than `count` are visible (mark it `cuda` too)."""
    found = visible_gpus()
    return pytest.mark.skipif(
        found < count, reason=f"needs {count} CUDA GPU{'s' if count > 1 else ''}; {found} visible"
    )


def run_gpu_script(name: str, *args: str, timeout: float = 300) -> runner.ScriptRun:
    """Run tests/gpu/scripts/NAME ARGS in its own session; the test fails if it does not finish in time."""
    return runner.run_python([str(GPU_SCRIPTS / name), *args], timeout=timeout)


def run_integration_script(name: str, *args: str, timeout: float = 300) -> runner.ScriptRun:
    """Run tests/integration/scripts/NAME ARGS (a CPU script that also takes a GPU argument)."""
    return runner.run_script(name, *args, timeout=timeout)

"""The README's main example runs as written and its loss goes down."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train.py"


@pytest.mark.multiprocess
def test_main_example_trains_on_two_cpu_processes() -> None:
    result = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    losses = [float(v) for v in re.findall(r"loss ([0-9.]+) \(world size 2\)", result.stdout)]
    assert len(losses) == 3, result.stdout
    assert losses[-1] < losses[0] * 0.5

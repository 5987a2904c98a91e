"""Under real DDP, methods other than forward have their gradients averaged when routed (2 processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "forward_methods_ddp.py"


@pytest.mark.multiprocess
def test_training_step_and_marked_methods_sync_gradients_under_ddp(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"training_step": True, "marked": True}

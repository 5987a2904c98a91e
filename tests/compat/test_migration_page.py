"""The before/after example of docs/migrating/lightning_fabric.md: the Lightning script, ported by the sed, runs."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "migrating" / "lightning_fabric.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def sed(text: str) -> str:
    """`sed 's/lightning.fabric/fabric/g; s/lightning_fabric/fabric/g'` ('.' matches any character)."""
    return re.sub("lightning_fabric", "fabric", re.sub("lightning.fabric", "fabric", text))


@pytest.mark.usefixtures("no_cluster_env")
def test_the_ported_example_of_the_migration_page_runs(tmp_path: Path) -> None:
    before = next(block for block in python_blocks(PAGE.read_text()) if "ThroughputMonitor(fabric" in block)
    after_imports = next(block for block in python_blocks(PAGE.read_text()) if block.startswith("from fabric import"))
    ported = sed(before)
    assert "lightning" not in ported
    assert all(line in ported.splitlines() for line in after_imports.splitlines())  # the page shows the real diff
    script = tmp_path / "ported.py"
    script.write_text(ported)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    assert len(re.findall(r"step \d+: loss [0-9.]+, \d+ samples/s", result.stdout)) == 2, result.stdout
    assert (tmp_path / "last.ckpt").is_file()
    with next((tmp_path / "logs").rglob("metrics.csv")).open() as handle:
        logged = [row for row in csv.DictReader(handle) if row["device/samples_per_sec"]]
    assert [row["step"] for row in logged] == ["8", "16"]

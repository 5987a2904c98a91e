"""examples/lightning_port.py is Lightning Fabric code after the documented sed, and runs (1 CPU process, resume).

When Lightning is installed, the same script with its imports turned back into `lightning.fabric` runs under
Lightning too and prints the same losses, which shows the port changed nothing but the imports. The ported
script's first run (20 steps) is made once for the module: the resume test continues it, and the comparison
with Lightning reads its losses.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_port.py"
SED = [("lightning.fabric", "fabric"), ("lightning_fabric", "fabric")]

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("no_cluster_env")]


def as_lightning_code(text: str) -> str:
    """The script as it was before the port: its `fabric` imports are Lightning's."""
    return re.sub(r"^from fabric", "from lightning.fabric", text, flags=re.MULTILINE)


def sed(text: str) -> str:
    """What `sed -i 's/lightning.fabric/fabric/g; s/lightning_fabric/fabric/g'` does ('.' matches any char)."""
    for pattern, replacement in SED:
        text = re.sub(pattern, replacement, text)
    return text


def run(script: Path, cwd: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FABRIC_")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, str(script), "--accelerator", "cpu", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def losses(stdout: str) -> list[float]:
    return [float(v) for v in re.findall(r"step \d+: loss ([0-9.]+)", stdout)]


@dataclass
class FirstRun:
    stdout: str
    cwd: Path  # what the run wrote: lightning_port/last.ckpt and its metrics


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> FirstRun:
    """The ported script for 20 steps on 1 CPU process, in a fresh folder."""
    cwd = tmp_path_factory.mktemp("ours")
    return FirstRun(run(EXAMPLE, cwd, "--max-steps", "20"), cwd)


def test_the_example_is_lightning_code_after_the_sed_one_liner() -> None:
    text = EXAMPLE.read_text()
    original = as_lightning_code(text)
    assert "from lightning.fabric.utilities import" in original and "from lightning.fabric.plugins import" in original
    assert sed(original) == text


def test_ported_script_trains_logs_throughput_and_resumes(first_run: FirstRun, tmp_path: Path) -> None:
    # The resumed run writes into a copy, so the module's first run stays as it finished.
    shutil.copytree(first_run.cwd, tmp_path, dirs_exist_ok=True)
    first = first_run.stdout
    first_losses = losses(first)
    assert len(first_losses) == 2 and first_losses[1] < first_losses[0], first
    assert re.search(r"step 20: loss [0-9.]+, \d+ samples/s", first), first
    assert "saved step 20 to lightning_port/last.ckpt (flops per batch: 1245184)" in first  # 3 * 2*64*(32*128+128*4)
    with (tmp_path / "lightning_port" / "metrics" / "version_0" / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    throughput_rows = [row for row in rows if row["device/samples_per_sec"]]
    assert [row["step"] for row in throughput_rows] == ["10", "20"]
    for row in throughput_rows:
        rate = float(row["device/batches_per_sec"])
        assert rate > 0 and float(row["device/samples_per_sec"]) == pytest.approx(64 * rate)
        assert float(row["device/flops_per_sec"]) == pytest.approx(1245184 * rate)

    resumed = run(EXAMPLE, tmp_path, "--max-steps", "30", "--resume", "lightning_port/last.ckpt")
    assert "resumed at step 20" in resumed and "saved step 30" in resumed, resumed
    assert len(losses(resumed)) == 1 and losses(resumed)[0] < first_losses[-1], resumed


def test_the_unported_script_gives_the_same_losses_under_lightning(first_run: FirstRun, tmp_path: Path) -> None:
    pytest.importorskip("lightning.fabric", reason="Lightning is not installed, so the original cannot run")
    original = tmp_path / "original.py"
    original.write_text(as_lightning_code(EXAMPLE.read_text()))
    (tmp_path / "lightning").mkdir()
    theirs = run(original, tmp_path / "lightning", "--max-steps", "20")
    ours = first_run.stdout  # the same arguments, in a fresh folder of its own
    assert losses(ours) == losses(theirs) and len(losses(ours)) == 2, (ours, theirs)
    assert "(flops per batch: 1245184)" in theirs

"""Our `fabric run` exports Lightning's LT_* variables: a script using Lightning's Fabric reads them too."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import _it_runner as runner
import pytest

pytest.importorskip("lightning", reason="lightning is not installed (pip install torchfabric[lightning])")
pytestmark = pytest.mark.multiprocess


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_lightning_fabric_and_ours_both_take_the_command_flags(tmp_path: Path) -> None:
    flags = ["--accelerator", "cpu", "--strategy", "ddp", "--devices", "2", "--precision", "bf16-true"]
    argv = ["-m", "fabric", "run", *flags, "--main-port", str(_free_port()), "cli_lightning.py", str(tmp_path)]
    run = runner.run_python(argv, timeout=180)  # ends torchrun and its workers if it does not finish
    assert run.returncode == 0, run.output
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["lightning"] == [2, rank, "DDPStrategy", "HalfPrecision"]
        assert report["ours"] == [2, rank, "DDPStrategy", "HalfPrecision"]
        assert report["sum"] == 3.0
        assert report["lt_env"] == {"LT_CLI_USED": "1", "LT_ACCELERATOR": "cpu", "LT_STRATEGY": "ddp",
                                    "LT_DEVICES": "2", "LT_NUM_NODES": "1", "LT_PRECISION": "bf16-true"}  # fmt: skip

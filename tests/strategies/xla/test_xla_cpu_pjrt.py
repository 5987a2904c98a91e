"""Real XLA runs on one CPU PJRT device (torch_xla installed, e.g. the torch 2.9 environment); skipped without it.

Each run is a fresh interpreter: torch_xla must be imported before the process's first backward (the autograd
engine learns the devices then), which a pytest process that ran other tests has long done.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parent / "scripts"
REPO = Path(__file__).resolve().parents[3]
# The CPU PJRT device repeats eager CPU arithmetic up to float rounding (measured: 6e-8 after 8 steps).
PARITY = 1e-6

pytestmark = [
    pytest.mark.xla,
    pytest.mark.skipif(
        importlib.util.find_spec("torch_xla") is None, reason="needs torch_xla (pip install torchfabric[xla])"
    ),
]


def run(script: str, *args: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_", "XLA_", "TPU_", "CPU_NUM"))}
    env.update(PJRT_DEVICE="CPU", PYTHONPATH=os.pathsep.join([str(REPO), str(SCRIPTS)]), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True, env=env, timeout=300
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, f"{script} failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return json.loads(lines[-1][len("RESULTS ") :])  # type: ignore[no-any-return]


def test_single_xla_trains_like_eager_cpu_and_checkpoints_load_without_torch_xla(tmp_path: Path) -> None:
    results = run("single_xla.py", str(tmp_path))
    assert results["strategy"] == "SingleDeviceXLAStrategy"  # accelerator='xla', devices=1 -> single_xla
    assert results["precision"] == "XLAPrecision"
    assert results["device"] == "xla:0"
    assert results["batch_devices"] == ["xla:0"]
    assert results["loader_type"] == "MpDeviceLoader"
    assert results["parity"] <= PARITY
    assert results["saved_devices"] == ["cpu"]
    assert results["reload"] == 0.0
    assert results["reload_step"] == 7
    assert results["momentum_device"] == "xla:0"
    assert results["io_devices"] == "cpu"
    assert results["bf16-true"] == {"param": "torch.bfloat16", "inner": ["torch.bfloat16"], "output": "torch.float32",
                                    "finite": True}  # fmt: skip
    assert results["bf16-mixed"] == {"param": "torch.float32", "inner": ["torch.bfloat16"], "output": "torch.float32",
                                     "finite": True}  # fmt: skip
    on_cpu = run("load_on_cpu.py", "plain", str(tmp_path / "single.ckpt"), str(tmp_path / "trained.pt"))
    assert on_cpu == {"difference": 0.0, "keys": [], "remainder": ["optimizer", "step"], "xla_imported": False}


def test_xla_strategy_launches_one_process_with_real_collectives(tmp_path: Path) -> None:
    results = run("xla_launched.py", str(tmp_path))
    assert results["strategy"] == "XLAStrategy"
    assert results["pid_is_launcher"]  # torch_xla runs a single process in the launching one
    assert results["ranks"] == [0, 0, 0, 1]
    assert results["device"] == "xla:0"
    assert results["sampler"] == "DistributedSampler"
    assert results["batch_devices"] == ["xla:0"]
    assert results["parity"] <= PARITY
    assert results["all_reduce_mean"] == [1.0, 4.0]
    assert results["all_reduce_max"] == [1.0, 4.0]
    assert results["all_gather_shape"] == [1, 2]
    assert results["broadcast_tensor"] == [1.0, 4.0]
    assert results["broadcast_object"] == {"path": "a/b", "n": [1, 2]}
    assert results["returned_tensor_device"] == "cpu"
    on_cpu = run("load_on_cpu.py", "plain", str(tmp_path / "xla.ckpt"), str(tmp_path / "trained.pt"))
    assert on_cpu == {"difference": 0.0, "keys": [], "remainder": ["optimizer"], "xla_imported": False}


def test_xla_fsdp_in_one_process_trains_checkpoints_and_consolidates_without_torch_xla(tmp_path: Path) -> None:
    results = run("xla_fsdp_one_process.py", str(tmp_path))
    for run_results in (results, results["nested"]):  # plain, and wrapped per layer with flattened parameters
        assert run_results["world_size"] == 1
        assert run_results["wrapper"] == "XlaFullyShardedDataParallel"
        assert run_results["files"] == ["checkpoint_rank-00000000-of-00000001.pth", "xla_fsdp.json"]
        assert run_results["full_is_file"]
        assert run_results["parity"] <= PARITY
        assert run_results["full_step"] == 8
    assert results["resume"] == {"step": 8, "reload": 0.0, "momentum": 4, "shard_keys": 4}
    for directory in (tmp_path, tmp_path / "nested"):
        trained = str(directory / "trained.pt")
        merged = run("load_on_cpu.py", "sharded", str(directory / "sharded"), trained)
        assert merged == {"difference": 0.0, "keys": ["model", "step"], "remainder": ["step"], "xla_imported": False}
        full = run("load_on_cpu.py", "plain", str(directory / "full.ckpt"), trained)
        assert full == {"difference": 0.0, "keys": [], "remainder": ["step"], "xla_imported": False}

"""One GPU, in its own processes: the default collectives and training steps add no host-device syncs to raw torch,
and torch's Flight Recorder records NCCL collectives as fabric leaves it set up.

Issue 21's rule for the default path: no wait for the GPU per call that raw torch does not make. torch's sync debug
mode counts the synchronizing CUDA calls of each case; the CPU suite checks the same with a fake device.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _gpu import needs_gpus, run_gpu_script

pytestmark = [pytest.mark.cuda, needs_gpus(1), pytest.mark.usefixtures("no_cluster_env")]


def test_default_collectives_and_steps_sync_no_more_than_raw_torch(tmp_path: Path) -> None:
    run = run_gpu_script("gpu_no_sync.py", str(tmp_path), timeout=180)
    assert run.returncode == 0, run.output
    result = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert result["backend"] == "nccl"
    assert result["item"] == 1, "the counter must see Tensor.item()'s sync, or every other count means nothing"
    assert result["all_gather"] == (0, 0)
    assert result["all_reduce sum"] == (0, 0)
    assert result["all_reduce mean"] == (0, 0)
    raw, fab = result["ddp step"]
    assert fab <= raw, result
    raw, fab = result["single-device step"]
    assert fab <= raw, result


def test_flight_recorder_records_nccl_collectives_without_a_deprecation_warning(tmp_path: Path) -> None:
    run = run_gpu_script("gpu_flight_recorder.py", str(tmp_path), timeout=180)
    assert run.returncode == 0, run.output
    result = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert sum("reduce" in op for op in result["ops"]) >= 3, result  # each all_reduce is in the dump
    assert result["env"]["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert "deprecated" not in run.stderr, run.stderr  # torch 2.11+ warns on TORCH_NCCL_TRACE_BUFFER_SIZE

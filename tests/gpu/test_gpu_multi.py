"""Multi-GPU runs in their own processes: NCCL DDP parity and collectives, fork launches with bf16, FSDP offload,
DeepSpeed fp16 loss scaling, device indices, and the pipeline bubble benchmark. Each test says how many GPUs it
needs and skips with the reason where fewer are visible.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from _gpu import needs_gpus, run_gpu_script, run_integration_script, runner

pytestmark = [pytest.mark.cuda, pytest.mark.multiprocess, pytest.mark.usefixtures("no_cluster_env")]


def _ranks(outdir: Path, count: int) -> list[dict[str, Any]]:
    return [torch.load(outdir / f"rank{rank}.pt", weights_only=False) for rank in range(count)]


def _bf16_everywhere() -> bool:
    return all(torch.cuda.get_device_capability(i)[0] >= 8 for i in range(2))


@needs_gpus(2)
def test_ddp_over_nccl_matches_raw_ddp_and_runs_every_collective(tmp_path: Path) -> None:
    run = run_gpu_script("gpu_ddp.py", str(tmp_path))
    assert run.returncode == 0, run.output
    results = _ranks(tmp_path, 2)
    for rank, result in enumerate(results):
        assert result["backend"] == "nccl"
        assert (result["device"], result["current_device"]) == (f"cuda:{rank}", rank)
        assert result["param_devices"] == [f"cuda:{rank}"]
        assert result["fabric"]["losses"] == result["raw"]["losses"]
        for name, expected in result["raw"]["weights"].items():
            assert torch.equal(result["fabric"]["weights"][name], expected), name
        assert result["broadcast"] == {"from": 1}
        assert result["all_gather"] == ("cuda", [0, 1])
        assert result["all_gather_uneven"] == [("cuda", [0]), ("cuda", [0, 1])]
        assert result["all_reduce"] == ("cuda", 3.0)
        assert result["any"] is True
        loaded = result["loaded"]
        assert loaded["weights_equal"] and loaded["step"] == 4 and loaded["extra"] == [0.0, 1.0, 2.0]
        assert loaded["param_devices"] == [f"cuda:{rank}"] and loaded["momentum_devices"] == [f"cuda:{rank}"]
    assert results[0]["fabric"]["weights"].keys() == results[1]["fabric"]["weights"].keys()


@needs_gpus(2)
@pytest.mark.parametrize("strategy", ["ddp_fork", "ddp_notebook"])
def test_fork_launches_with_bf16_mixed(tmp_path: Path, strategy: str) -> None:
    if not _bf16_everywhere():
        pytest.skip("needs GPUs with bfloat16 (compute capability 8.0 or newer)")
    run = run_gpu_script("gpu_fork.py", str(tmp_path), strategy)
    assert run.returncode == 0, run.output
    parent = torch.load(tmp_path / "parent.pt", weights_only=False)
    assert parent == {"cuda_initialised_before_launch": False, "cuda_initialised_after_launch": False}
    for rank, result in enumerate(_ranks(tmp_path, 2)):
        assert (result["device"], result["current_device"]) == (f"cuda:{rank}", rank)
        assert result["autocast_dtypes"] == ["torch.bfloat16"]
        assert result["losses"][-1] < result["losses"][0]


@needs_gpus(2)
def test_fsdp_offload_clipping_and_sharded_checkpoint_on_two_gpus(tmp_path: Path) -> None:
    run = run_integration_script("fsdp_offload_clip.py", str(tmp_path), "cuda")
    assert run.returncode == 0, run.output
    results = _ranks(tmp_path, 2)
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
        assert result["backend"] == "cpu:gloo,cuda:nccl"
        fsdp = result["fsdp"]
        assert fsdp["shard_devices"] == ["cpu"] and fsdp["grad_devices"] == ["cpu"]
        assert fsdp["built_on"] == ["cpu"], "init_module must not build the whole model on every GPU"
        assert all(torch.isfinite(torch.tensor(fsdp["norms"]))) and min(fsdp["norms"]) > 0
        assert fsdp["losses"][-1] < fsdp["losses"][0]
        scaler = result["scaler"]
        assert scaler["saved"]["scale"] < 2.0**24 and scaler["loaded"] == scaler["saved"]
    assert results[0]["fsdp"]["norms"] == results[1]["fsdp"]["norms"], "the norm is global, the same on all ranks"
    assert results[0]["fsdp"]["losses"] == results[1]["fsdp"]["losses"]


@needs_gpus(2)
def test_deepspeed_fp16_loss_scaling_with_offload(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    run = run_gpu_script("gpu_deepspeed_fp16.py", str(tmp_path), timeout=600)
    assert run.returncode == 0, run.output
    for result in _ranks(tmp_path, 2):
        assert result["param_dtypes"] == ["torch.float16"]
        overflow = result["overflow"]
        assert overflow["weights_unchanged"], "a step with inf gradients must be skipped"
        assert overflow["scale_after"] == overflow["scale_before"] / 2
        assert result["losses"][-1] < result["losses"][0]
        assert result["norm"] > 0
        assert result["resumed_scale"] == result["scale"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed"])
@pytest.mark.parametrize(
    ("indices", "gpus"), [pytest.param("1", 2, marks=needs_gpus(2)), pytest.param("1,3", 4, marks=needs_gpus(4))]
)
def test_device_indices_are_honoured(tmp_path: Path, strategy: str, indices: str, gpus: int) -> None:
    if strategy == "deepspeed":
        pytest.importorskip("deepspeed")
        if not _bf16_everywhere():
            pytest.skip("the DeepSpeed run uses bf16-mixed: needs compute capability 8.0 or newer")
    run = run_gpu_script("gpu_devices.py", str(tmp_path), strategy, indices, timeout=600)
    assert run.returncode == 0, run.output
    expected = [int(i) for i in indices.split(",")]
    for rank, result in enumerate(_ranks(tmp_path, len(expected))):
        gpu = expected[rank]
        assert (result["device"], result["current_device"]) == (f"cuda:{gpu}", gpu)
        assert result["param_devices"] == [f"cuda:{gpu}"] and result["input_device"] == f"cuda:{gpu}"
        assert result["world_size"] == len(expected)
        assert result["losses"][-1] < result["losses"][0]


@needs_gpus(2)
def test_pipeline_bubble_on_two_gpus() -> None:
    """benchmarks/pipeline_bubble.py on 2 GPUs over NCCL: every schedule steps; the table is the measurement."""
    script = Path(__file__).parents[2] / "benchmarks" / "pipeline_bubble.py"
    run = runner.run_python([str(script), "--accelerator", "cuda", "--devices", "2", "--steps", "3"], timeout=300)
    assert run.returncode == 0, run.output
    for schedule in ("GPipe", "1F1B", "Interleaved1F1B"):
        assert re.search(rf"^{schedule}\s+2\s+\d\s+\d+\s+[\d.]+", run.stdout, re.MULTILINE), run.output
    print(run.stdout)  # the measured bubble against the theory, for the person who ran the suite

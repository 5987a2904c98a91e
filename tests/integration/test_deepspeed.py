"""DeepSpeed ZeRO 1-3 on two real CPU processes over gloo, and reloading their checkpoints in one process.

scripts/ds_ranks.py runs every scenario once (DeepSpeed compiles its CPU communication op on first use, ~75-200 s,
cached in ~/.cache/torch_extensions afterwards); the tests below assert on what each process observed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import _it_runner as runner
import pytest
import torch
from torch import nn

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install torchfabric[deepspeed])")

pytestmark = pytest.mark.multiprocess

# Parity tolerance. Without clipping, ZeRO's float32 reduce-scatter of 2 ranks adds the same two numbers as DDP's
# all-reduce and divides by 2 the same way, and AdamW steps each element independently, so the result is bit for bit
# DDP's. With clipping, DeepSpeed computes the norm from per-partition squared sums and scales by
# max_norm / (norm + 1e-6) in its own order, which moves the last bits: a few float32 ulps of weights ~0.5.
CLIP_ATOL = 1e-6


@pytest.fixture(scope="module")
def outdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("deepspeed")
    run = runner.run_script("ds_ranks.py", str(folder), timeout=420)
    assert run.returncode == 0, run.output
    return folder


def _check(outdir: Path, name: str) -> list[Any]:
    """One check's result on rank 0 and rank 1, failing with the rank's traceback if it raised."""
    results = [torch.load(outdir / f"rank{rank}.pt", weights_only=False)[name] for rank in (0, 1)]
    for rank, result in enumerate(results):
        if isinstance(result, dict) and "Traceback" in str(result.get("error", "")):
            pytest.fail(f"{name} raised on rank {rank}:\n{result['error']}")
    return results


def _single(outdir: Path) -> dict[str, Any]:
    result = torch.load(outdir / "single.pt", weights_only=False)
    if "error" in result:
        pytest.fail(f"the single process raised:\n{result['error']}")
    return result


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_matches_ddp_bit_for_bit(outdir: Path, stage: int) -> None:
    for rank, result in enumerate(_check(outdir, "parity")):
        ddp, ds = result["ddp"], result[f"stage{stage}"]
        assert ds["losses"] == ddp["losses"], f"rank {rank}"
        assert _max_diff(ds["weights"], ddp["weights"]) == 0.0, f"rank {rank}"
        assert ds["is_dir"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clip_gradients_uses_the_global_norm_of_all_shards(outdir: Path, stage: int) -> None:
    for rank, result in enumerate(_check(outdir, "parity")):
        ddp, ds = result["ddp_clip"], result[f"stage{stage}_clip"]
        # The norm returned is DDP's total norm (both ranks agree), not the norm of this rank's shard.
        assert ds["norms"] == pytest.approx(ddp["norms"], rel=1e-6), f"rank {rank}"
        assert all(norm > 0.05 for norm in ddp["norms"])  # so clipping really changed the step
        assert ds["losses"] == pytest.approx(ddp["losses"], abs=CLIP_ATOL)
        assert _max_diff(ds["weights"], ddp["weights"]) <= CLIP_ATOL
        assert _max_diff(ds["weights"], result[f"stage{stage}"]["weights"]) > 1e-4  # clipped != unclipped


@pytest.mark.parametrize("stage", [2, 3])
def test_save_and_load_on_the_same_world_size_resumes_exactly(outdir: Path, stage: int) -> None:
    for result in _check(outdir, "roundtrip"):
        observed = result[f"stage{stage}"]
        assert observed["observed"] == observed["expected"]  # weights restored into a differently seeded model
        assert observed["step"] == 2
        assert observed["note"] == {"text": "kept"}
        assert "checkpoint" in observed["listing"] and "latest" in observed["listing"]
        assert observed["siblings"] == []  # the second save replaced the first and left no temporary folder


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_of_two_ranks_loads_model_weights_on_one(outdir: Path, stage: int) -> None:
    single = _single(outdir)[f"stage{stage}"]
    rank0 = _check(outdir, "parity")[0][f"stage{stage}"]
    assert _max_diff(single["weights"], rank0["weights"]) == 0.0  # consolidation gives the trained weights
    plain = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    plain.load_state_dict(single["weights"])
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)
    assert torch.allclose(single["output"], plain(x), atol=1e-6)
    assert single["step"] == 3
    assert any("only the model weights were restored" in w for w in single["warnings"])
    # The next step starts from the loaded weights with a fresh AdamW: DeepSpeed's master copy was refreshed.
    optimizer = torch.optim.AdamW(plain.parameters(), lr=0.05)
    nn.functional.cross_entropy(plain(x), y).backward()
    optimizer.step()
    assert _max_diff(single["after_step"], plain.state_dict()) <= 1e-6


@pytest.mark.parametrize("stage", [2, 3])
def test_fabric_consolidate_turns_a_deepspeed_checkpoint_into_one_file(
    outdir: Path, stage: int, tmp_path: Path
) -> None:
    output = tmp_path / "whole.pt"
    checkpoint = outdir / f"parity_stage{stage}_None"
    command = [sys.executable, "-m", "fabric", "consolidate", str(checkpoint), str(output)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    whole = torch.load(output)
    trained = _check(outdir, "parity")[0][f"stage{stage}"]["weights"]
    assert _max_diff(whole["model"], trained) == 0.0
    assert whole["step"] == 3
    assert "optimizer" not in whole  # ZeRO's flat shards fit no plain optimizer; the docs say so


def test_a_plain_strategy_loads_the_weights_of_a_deepspeed_checkpoint(outdir: Path) -> None:
    from fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model = fabric.setup(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)))
    state: dict[str, Any] = {"model": model, "step": 0}
    remainder = fabric.load(outdir / "parity_stage3_None", state)
    trained = _check(outdir, "parity")[0]["stage3"]["weights"]
    assert _max_diff(model.state_dict(), trained) == 0.0
    assert state["step"] == 3
    assert remainder == {}


def test_stage3_init_module_inference_and_collectives(outdir: Path) -> None:
    for rank, result in enumerate(_check(outdir, "inference")):
        assert result["init_module_partitioned"], f"rank {rank}"
        assert result["forward_matches"], f"rank {rank}"
        assert result["all_reduce"] == [3.0]
        assert result["all_gather"] == [1.0, 2.0]
        assert result["broadcast"] == {"from": 1}
        assert result["barrier"]


ERRORS = {
    "foreign_optimizer": "ValueError: fabric.setup(Sequential, ..., SGD): none of the optimizer's 4 parameters belongs",
    "partly_foreign_optimizer": "ValueError: fabric.setup(Sequential, SGD): 1 of the optimizer's parameters do not",
    "two_optimizers": "ValueError: fabric.setup(model, 2 optimizers): DeepSpeed drives exactly one optimizer",
    "setup_optimizers": "RuntimeError: fabric.setup_optimizers(): strategy DeepSpeedStrategy must see the model",
    "backward_without_optimizer": "RuntimeError: fabric.backward(loss): the DeepSpeed engine has no optimizer",
    "no_backward_sync": "NotImplementedError: fabric.no_backward_sync(): DeepSpeed cannot skip gradient sync",
    "clip_val": "NotImplementedError: fabric.clip_gradients(clip_val=0.1): DeepSpeed cannot clamp gradient values",
    "clip_norm_type": "ValueError: fabric.clip_gradients(norm_type=1.0): DeepSpeed computes only the L2 norm",
    "filter": "ValueError: save(",
    "missing_rank_file": "FileNotFoundError: load(",
    "not_a_checkpoint": "ValueError: load(",
    "missing_key": "KeyError: ",
}
ERROR_DETAILS = {
    "filter": "DeepSpeed writes its own sharded files and cannot filter them. Drop the filter.",
    "missing_rank_file": "written by 2 ranks, but the file of rank 1",
    "not_a_checkpoint": "not a DeepSpeed checkpoint directory",
    "missing_key": "the checkpoint has no entry for ['x']",
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_misuse_gives_a_clear_error_on_every_rank(outdir: Path, name: str) -> None:
    expected_type, expected_text = ERRORS[name].split(": ", 1)
    for rank, result in enumerate(_check(outdir, "errors")):
        message = result[name]
        assert message is not None, f"rank {rank}: no error"
        raised_type, text = message.split(": ", 1)
        # FabricValueError / FabricTypeError subclass the builtin types the users catch.
        assert raised_type.endswith(expected_type) and text.startswith(expected_text), f"rank {rank}: {message}"
        assert ERROR_DETAILS.get(name, "") in message


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")
def test_stage3_offload_trains_on_cuda(tmp_path: Path) -> None:
    run = runner.run_script("ds_cuda_offload.py", str(tmp_path), timeout=600)
    assert run.returncode == 0, run.output
    assert "losses decrease" in run.stdout, run.output

"""The same training loop in raw PyTorch DDP and in fabric (2 CPU ranks over gloo) ends with equal weights, bit for bit.

scripts/parity_train.py runs each variant (SGD with momentum, AdamW, SGD with gradient accumulation over 2
micro-batches) in both modes: raw DDP + DistributedSampler(shuffle=True, seed=S) + set_epoch, and fabric with
strategy="ddp", seed_everything(S), setup, setup_dataloaders (which injects that sampler) and fabric.backward.
"""

from __future__ import annotations

from pathlib import Path

import _it_runner as runner
import pytest
import torch

pytestmark = pytest.mark.multiprocess
VARIANTS = ("sgd", "adamw", "sgd_accumulate")


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Runs both modes once for the whole module, in one job (raw first, in ranks forked before fabric.launch());
    every variant's weights land in one folder."""
    outdir = tmp_path_factory.mktemp("parity")
    run = runner.run_script("parity_train.py", str(outdir), timeout=180)
    assert run.returncode == 0, run.output
    return outdir


def _load(outdir: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(outdir / f"{name}.pt", weights_only=True)


def _assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        diff = (a[key] - b[key]).abs().max().item()
        assert torch.equal(a[key], b[key]), f"{what}: {key} differs (max abs difference {diff})"


@pytest.mark.parametrize("variant", VARIANTS)
def test_both_modes_start_from_the_same_weights_and_train(weights_dir: Path, variant: str) -> None:
    raw_init = _load(weights_dir, f"raw_{variant}_init_rank0")
    _assert_bitwise_equal(raw_init, _load(weights_dir, f"fabric_{variant}_init_rank0"), "initial weights")
    final = _load(weights_dir, f"fabric_{variant}_rank0")
    assert any(not torch.equal(raw_init[k], final[k]) for k in final), "training changed nothing"


@pytest.mark.parametrize("mode", ["raw", "fabric"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_replicas_agree(weights_dir: Path, mode: str, variant: str) -> None:
    rank0 = _load(weights_dir, f"{mode}_{variant}_rank0")
    _assert_bitwise_equal(rank0, _load(weights_dir, f"{mode}_{variant}_rank1"), f"{mode} rank 0 vs rank 1")


@pytest.mark.parametrize("variant", ["sgd", "adamw"])
def test_fabric_matches_raw_ddp_bit_for_bit(weights_dir: Path, variant: str) -> None:
    raw = _load(weights_dir, f"raw_{variant}_rank0")
    _assert_bitwise_equal(raw, _load(weights_dir, f"fabric_{variant}_rank0"), f"{variant}: raw DDP vs fabric")


def test_gradient_accumulation_matches_raw_no_sync(weights_dir: Path) -> None:
    raw = _load(weights_dir, "raw_sgd_accumulate_rank0")
    fabric = _load(weights_dir, "fabric_sgd_accumulate_rank0")
    _assert_bitwise_equal(raw, fabric, "accumulation: raw DDP no_sync vs fabric.no_backward_sync")
    # Accumulating really changed the run: half as many optimizer steps as the plain SGD variant.
    plain = _load(weights_dir, "fabric_sgd_rank0")
    assert any(not torch.equal(plain[k], fabric[k]) for k in plain)

"""The same seed gives the same numbers as Lightning Fabric: Lightning's image-classifier loop on 2 CPU ranks.

scripts/lightning_classifier.py runs the loop of Lightning's examples/fabric/image_classifier/train_fabric.py
(synthetic MNIST-shaped data whose items add noise from torch, `random` and numpy, a shuffled training loader,
dropout, Adadelta, StepLR, two epochs) once under Lightning Fabric and once under ours, each in its own
processes. Every per-batch training loss and every test loss must be equal bit for bit, on both ranks, with
num_workers=0, with num_workers=2, and with num_workers=2 and seeded workers.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

# The integration tests' process runner (hard timeouts, a clean environment, one thread per rank).
sys.path.insert(0, str(Path(__file__).parents[1] / "integration" / "scripts"))
import _it_runner as runner

pytest.importorskip("lightning.fabric", reason="the comparison needs Lightning Fabric (pip install lightning)")
pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).parent / "scripts" / "lightning_classifier.py"
CONFIGS = "0,2,2w"  # no workers; two workers seeded by torch alone; two seeded by seed_everything(workers=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _results(outdir: Path, args: list[str]) -> list[dict[str, Any]]:
    run = runner.run_python(args, timeout=180)
    assert run.returncode == 0, run.output
    return [json.loads((outdir / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def _launched(impl: str, outdir: Path, configs: str) -> list[dict[str, Any]]:
    """Fabric(accelerator="cpu", strategy="ddp", devices=2) and fabric.launch() in the script."""
    return _results(outdir, [str(SCRIPT), impl, str(outdir), "--configs", configs, "--shuffle"])


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _launched("lightning", tmp_path_factory.mktemp("lightning"), CONFIGS)


def _assert_same_numbers(expected: list[dict[str, Any]], actual: list[dict[str, Any]], config: str) -> None:
    for rank in (0, 1):
        want, got = expected[rank][config], actual[rank][config]
        assert len(got["losses"]) == len(want["losses"]) == 6  # 2 epochs of 3 batches on each rank
        for index, (a, b) in enumerate(zip(want["losses"], got["losses"], strict=True)):
            assert a == b, f"{config=} rank {rank}: batch {index} loss {float.fromhex(b)} != {float.fromhex(a)}"
        assert got["test_losses"] == want["test_losses"], f"{config=} rank {rank}: test losses differ"


def test_same_seed_gives_lightnings_per_batch_losses(lightning_run: list[dict[str, Any]], tmp_path: Path) -> None:
    ours = _launched("fabric", tmp_path, CONFIGS)
    for config in CONFIGS.split(","):
        _assert_same_numbers(lightning_run, ours, config)
    # The comparison has teeth: the ranks read different shards, and the seeded workers' noise shows.
    assert ours[0]["0"]["losses"] != ours[1]["0"]["losses"]
    assert ours[0]["0"]["losses"] != ours[0]["2"]["losses"] != ours[0]["2w"]["losses"]


def test_lightnings_seed_everything_with_our_fabric(lightning_run: list[dict[str, Any]], tmp_path: Path) -> None:
    # lightning.fabric.seed_everything records the seed only in PL_GLOBAL_SEED / PL_SEED_WORKERS; our sampler
    # and worker seeding read them when FABRIC_GLOBAL_SEED is absent.
    mixed = _launched("mixed", tmp_path, "2w")
    _assert_same_numbers(lightning_run, mixed, "2w")


def test_the_example_as_written_through_both_run_commands(tmp_path: Path) -> None:
    # The example calls Fabric() with no arguments and no launch(): the command line supplies the flags.
    # Both commands keep an OMP_NUM_THREADS that is set (the runner sets 1); without it their thread
    # counts differ, and so do the last bits of the sums (docs/dataloaders.md explains).
    common = ["--accelerator", "cpu", "--devices", "2", "--main-port"]
    theirs_dir, ours_dir = tmp_path / "lightning", tmp_path / "fabric"
    theirs_cli = ["-m", "lightning.fabric.cli", *common, str(_free_port())]
    theirs = _results(theirs_dir, [*theirs_cli, str(SCRIPT), "lightning", str(theirs_dir), "--cli"])
    ours_cli = ["-m", "fabric", "run", *common, str(_free_port())]
    ours = _results(ours_dir, [*ours_cli, str(SCRIPT), "fabric", str(ours_dir), "--cli"])
    _assert_same_numbers(theirs, ours, "0")
    assert theirs[0]["threads"] == ours[0]["threads"] == 1


@pytest.mark.parametrize("cores", [1, 3, 8])
def test_ranks_get_lightnings_cpu_thread_count(monkeypatch: pytest.MonkeyPatch, cores: int) -> None:
    # Both count the cores of this process's CPU set, not the machine's, and divide them among the ranks.
    from lightning.fabric.utilities.distributed import _suggested_max_num_threads

    from fabric.strategies.parallel import _share_cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    before = torch.get_num_threads()
    try:
        _share_cpu_threads(2)
        assert torch.get_num_threads() == _suggested_max_num_threads(2) == max(1, cores // 2)
    finally:
        torch.set_num_threads(before)

"""The same seed gives the same numbers as Lightning Fabric: Lightning's image-classifier loop on 2 CPU ranks.

scripts/lightning_classifier.py runs the loop of Lightning's examples/fabric/image_classifier/train_fabric.py
(synthetic MNIST-shaped data whose items add noise from torch, `random` and numpy, a shuffled training loader,
dropout, Adadelta, StepLR, two epochs) once under Lightning Fabric and once under ours, each in its own
processes. Every per-batch training loss and every test loss must be equal bit for bit, on both ranks, with
num_workers=0, with num_workers=2, and with num_workers=2 and seeded workers.

Each job costs seconds of process start-up per rank (torch, and Lightning where it is imported), so Lightning's
numbers are computed once for the module, our launched processes compute every config the tests compare in one
job, and the example run through our `fabric run` is compared with Lightning's numbers from that same module run.
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


@pytest.fixture(scope="module")
def our_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    # One job for both tests of our launched Fabric. "pl:2w" (our Fabric, Lightning's seed_everything) goes
    # first: our seed_everything, which the other configs call, records the seed in our variables too, and the
    # pl: config must find only Lightning's. Each config seeds all three generators again and builds its own
    # loaders, model and optimizer, so its numbers do not depend on the configs before it.
    return _launched("fabric", tmp_path_factory.mktemp("fabric"), f"pl:2w,{CONFIGS}")


def _assert_same_numbers(expected: list[dict[str, Any]], actual: list[dict[str, Any]], config: str) -> None:
    for rank in (0, 1):
        want, got = expected[rank][config], actual[rank][config]
        assert len(got["losses"]) == len(want["losses"]) == 6  # 2 epochs of 3 batches on each rank
        for index, (a, b) in enumerate(zip(want["losses"], got["losses"], strict=True)):
            assert a == b, f"{config=} rank {rank}: batch {index} loss {float.fromhex(b)} != {float.fromhex(a)}"
        assert got["test_losses"] == want["test_losses"], f"{config=} rank {rank}: test losses differ"


def test_same_seed_gives_lightnings_per_batch_losses(
    lightning_run: list[dict[str, Any]], our_run: list[dict[str, Any]]
) -> None:
    ours = our_run
    for config in CONFIGS.split(","):
        _assert_same_numbers(lightning_run, ours, config)
    # The comparison has teeth: the ranks read different shards, and the seeded workers' noise shows.
    assert ours[0]["0"]["losses"] != ours[1]["0"]["losses"]
    assert ours[0]["0"]["losses"] != ours[0]["2"]["losses"] != ours[0]["2w"]["losses"]


def test_lightnings_seed_everything_with_our_fabric(
    lightning_run: list[dict[str, Any]], our_run: list[dict[str, Any]]
) -> None:
    # lightning.fabric.seed_everything records the seed only in PL_GLOBAL_SEED / PL_SEED_WORKERS; our sampler
    # and worker seeding read them when FABRIC_GLOBAL_SEED is absent.
    # The pl: config shares our launched job with the others, and runs before any of our seeding.
    assert [our_run[rank]["pl:2w"]["our_seed_variable"] for rank in (0, 1)] == [None, None]
    expected = [{"pl:2w": lightning_run[rank]["2w"]} for rank in (0, 1)]
    _assert_same_numbers(expected, our_run, "pl:2w")


def test_the_example_as_written_through_our_run_command_gives_lightnings_numbers(
    lightning_run: list[dict[str, Any]], tmp_path: Path
) -> None:
    # The example calls Fabric() with no arguments and no launch(): our `fabric run` supplies the flags. Its
    # numbers are Lightning's for the same loop (the module's launched Lightning run: the same accelerator, 2
    # ranks, ddp). Both keep an OMP_NUM_THREADS that is set (the runner sets 1); without it the thread counts
    # can differ, and so do the last bits of the sums (docs/dataloaders.md explains).
    ours_cli = ["-m", "fabric", "run", "--accelerator", "cpu", "--devices", "2", "--main-port", str(_free_port())]
    ours = _results(tmp_path, [*ours_cli, str(SCRIPT), "fabric", str(tmp_path), "--cli", "--configs", "0", "--shuffle"])
    _assert_same_numbers(lightning_run, ours, "0")
    assert lightning_run[0]["threads"] == ours[0]["threads"] == 1


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

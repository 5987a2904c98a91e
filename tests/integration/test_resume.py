"""Exact mid-epoch resume on real processes: a run stopped at an arbitrary step and resumed from its checkpoint in
new processes sees the same batches on every rank and ends with the weights of the uninterrupted run, bit for bit.

scripts/resume_train.py trains a shuffled loop (SGD with momentum) for 17 steps, into the third epoch; the "stop"
run saves model, optimizer and loader at step 5 (2 ranks) or 9 (one process) and exits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _it_runner as runner
import pytest
import torch
from torch.utils.data import DistributedSampler

pytestmark = pytest.mark.multiprocess
pytest.importorskip("torchdata", reason="torchdata is not installed (pip install torchfabric[resume])")

SCENARIOS_2 = ["ddp0", "ddp2", "fsdp0"]  # strategy + num_workers
SCENARIOS_1 = ["single0", "single2"]


def _run(outdir: Path, *args: str, ckpt_dir: Path | None = None, timeout: float = 240) -> None:
    import os

    if ckpt_dir is not None:
        os.environ["CKPT_DIR"] = str(ckpt_dir)  # the runner passes this process's environment on
    try:
        run = runner.run_script("resume_train.py", str(outdir), *args, timeout=timeout)
    finally:
        os.environ.pop("CKPT_DIR", None)
    assert run.returncode == 0, run.output


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    outdir = tmp_path_factory.mktemp("resume2")
    scenarios = "ddp:0,ddp:2,fsdp:0"
    _run(outdir, "2", "first", "5", scenarios)
    _run(outdir, "2", "resume", "5", scenarios)
    return outdir


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    outdir = tmp_path_factory.mktemp("resume1")
    _run(outdir, "1", "first", "9", "single:0,single:2")
    _run(outdir, "1", "resume", "9", "single:0,single:2")
    return outdir


@pytest.fixture(scope="module")
def resized(two_ranks: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-rank checkpoints loaded by one process: the epoch-boundary one, then the mid-epoch one."""
    outdir = tmp_path_factory.mktemp("resized")
    _run(outdir, "1", "resize", "0", "ddp:0,fsdp:0", ckpt_dir=two_ranks)
    return outdir


def _result(outdir: Path, name: str, run: str, rank: int, allow_error: bool = False) -> dict[str, Any]:
    result = torch.load(outdir / f"{name}_{run}_rank{rank}.pt", weights_only=False)
    if "error" in result and not allow_error:
        pytest.fail(f"{name} {run} raised on rank {rank}:\n{result['error']}")
    return result


def _flat(batches: list[list[int]]) -> list[int]:
    return [index for batch in batches for index in batch]


def _assert_resumed_equals_uninterrupted(outdir: Path, name: str, rank: int, epochs: int) -> None:
    full = _result(outdir, name, "full", rank)
    stopped = _result(outdir, name, "stop", rank)
    resumed = _result(outdir, name, "resume", rank)
    assert stopped["seen"] and resumed["seen"], "both parts trained"
    assert stopped["seen"] + resumed["seen"] == full["seen"], "the resumed run saw other batches"
    assert full["weights"].keys() == resumed["weights"].keys()
    for key, value in full["weights"].items():
        assert torch.equal(value, resumed["weights"][key]), f"{name} rank {rank}: {key} differs"
    assert resumed["epoch"] == full["epoch"] == epochs, "the epoch counter (the sampler's shuffle) carried over"
    if name.endswith("0"):  # without workers the dataset's own state is restored in this process
        assert resumed["restored_from"] == rank, "each rank got its own loader state back"


@pytest.mark.parametrize("name", SCENARIOS_2)
@pytest.mark.parametrize("rank", [0, 1])
def test_two_ranks_resume_mid_epoch_bit_for_bit(two_ranks: Path, name: str, rank: int) -> None:
    _assert_resumed_equals_uninterrupted(two_ranks, name, rank, epochs=3)


def test_the_ranks_read_different_shards(two_ranks: Path) -> None:
    seen = [_flat(_result(two_ranks, "ddp0", "full", rank)["seen"][:7]) for rank in (0, 1)]
    assert not set(seen[0]) & set(seen[1]), "each rank reads its own half of epoch 0"


def test_ddp_checkpoint_holds_every_ranks_loader_state(two_ranks: Path) -> None:
    saved = torch.load(two_ranks / "ckpt_ddp2", weights_only=True)["loader"]
    assert saved["world_size"] == 2 and sorted(saved["ranks"]) == ["0", "1"]
    assert all(state["mid_epoch"] and state["batches"] == 5 for state in saved["ranks"].values())


def test_fsdp_checkpoint_is_a_directory(two_ranks: Path) -> None:
    assert (two_ranks / "ckpt_fsdp0").is_dir() and (two_ranks / "ckpt_fsdp0" / ".metadata").exists()


@pytest.mark.parametrize("name", SCENARIOS_1)
def test_one_process_resumes_mid_epoch_bit_for_bit(one_process: Path, name: str) -> None:
    _assert_resumed_equals_uninterrupted(one_process, name, 0, epochs=2)
    seen = _result(one_process, name, "full", 0)["seen"]
    assert sorted(_flat(seen[:13])) == list(range(50)), "one epoch reads every sample once"
    assert seen[:13] != seen[13:26], "each epoch is shuffled anew"


@pytest.mark.parametrize("name", ["ddp0", "fsdp0"])
def test_epoch_boundary_state_resumes_on_another_world_size(resized: Path, name: str) -> None:
    result = _result(resized, name, "boundary", 0)
    # The checkpoint was saved after step 7, so the run goes on for the 10 steps left, all in epoch 1.
    assert len(result["seen"]) == 10 and result["epoch"] == 2, "the saved next epoch (1) was started"
    sampler = DistributedSampler(range(50), num_replicas=1, rank=0, shuffle=True, seed=77)
    sampler.set_epoch(1)
    expected = list(sampler)[:40]
    assert _flat(result["seen"]) == expected, "epoch 1 in one process's order, from its first batch"


@pytest.mark.parametrize("name", ["ddp0", "fsdp0"])
def test_mid_epoch_state_refuses_another_world_size(resized: Path, name: str) -> None:
    error = _result(resized, name, "resume", 0, allow_error=True)["error"]
    assert (
        "FabricValueError: load(state['loader']): the loader state was saved by 2 ranks in the middle of epoch 0 "
        "(after 5 batches), and this run has 1." in error
    )
    assert "Resume on 2 ranks, or save at an epoch boundary" in error


@pytest.fixture(scope="module")
def deepspeed_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install torchfabric[deepspeed])")
    outdir = tmp_path_factory.mktemp("resume_ds")
    # DeepSpeed loads (or on first use compiles, ~75 s) its CPU communication op in each run.
    _run(outdir, "2", "first", "5", "deepspeed:0", timeout=420)
    _run(outdir, "2", "resume", "5", "deepspeed:0", timeout=420)
    return outdir


@pytest.mark.parametrize("rank", [0, 1])
def test_deepspeed_zero2_resumes_mid_epoch_bit_for_bit(deepspeed_ranks: Path, rank: int) -> None:
    assert (deepspeed_ranks / "ckpt_deepspeed0").is_dir(), "DeepSpeed writes a checkpoint directory"
    _assert_resumed_equals_uninterrupted(deepspeed_ranks, "deepspeed0", rank, epochs=3)


def test_the_docs_example_resumes_to_the_uninterrupted_result(tmp_path: Path) -> None:
    """docs/resume.md's example, run as the page says: stopped at step 30, then resumed, ends like one full run."""
    import re
    import subprocess
    import sys

    page = (Path(__file__).parents[2] / "docs" / "resume.md").read_text()
    script = next(block for block in re.findall(r"```python\n(.*?)```", page, re.S) if "--stop-at" in block)
    example = tmp_path / "resume_example.py"
    example.write_text(script)

    def run(folder: Path, *args: str) -> str:
        # In its own folder: the example writes checkpoints/ under the working directory.
        folder.mkdir(exist_ok=True)
        proc = subprocess.Popen(
            [sys.executable, str(example), *args], cwd=folder, env=runner.script_env(), start_new_session=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            runner.end_group(proc.pid)
            pytest.fail(f"the docs example {args} did not finish within 240 s")
        runner.end_group(proc.pid)
        assert proc.returncode == 0, stdout + stderr
        return stdout

    full = run(tmp_path / "full")
    assert "done: step 48" in full, full
    run(tmp_path / "stopped", "--stop-at", "30")
    resumed = run(tmp_path / "stopped")
    assert "resumed at step 30, epoch 1" in resumed, resumed
    assert full.splitlines()[-1] == resumed.splitlines()[-1], "the same final loss as the uninterrupted run"

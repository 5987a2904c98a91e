"""SpikeDetection / TrainingSpikeException behave as Lightning Fabric's loss-spike detector."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fabric.utilities.spike import SpikeDetection, TrainingSpikeException

SCRIPT = Path(__file__).parent / "scripts" / "spike_ranks.py"


class _OneRank:
    """The slice of a Fabric the detector uses, for one process; counts the collectives it is asked for."""

    def __init__(self) -> None:
        self.global_rank = 0
        self.decisions: list[tuple[bool, bool]] = []
        self.strategy = SimpleNamespace(reduce_boolean_decision=self._decide)

    def _decide(self, decision: bool, all: bool = True) -> bool:
        self.decisions.append((decision, all))
        return decision


def _run(detector: SpikeDetection, losses: list[float]) -> int | None:
    fabric: Any = _OneRank()
    for batch_idx, loss in enumerate(losses):
        try:
            detector.on_train_batch_end(fabric, torch.tensor(loss), None, batch_idx)
        except TrainingSpikeException:
            return batch_idx
    return None


def test_a_jump_above_rtol_times_the_mean_stops_and_records_this_and_the_previous_batch(tmp_path: Path) -> None:
    detector = SpikeDetection(exclude_batches_path=tmp_path)
    with pytest.raises(TrainingSpikeException, match="Training spike detected in batch 4"):
        fabric: Any = _OneRank()
        for batch_idx, loss in enumerate([1.0, 0.9, 0.8, 0.7, 5.0]):
            detector.on_train_batch_end(fabric, torch.tensor(loss), None, batch_idx)
    assert json.loads((tmp_path / "skip_batches.json").read_text()) == [3, 4]
    assert detector.bad_batches == [3, 4]


def test_falling_or_small_rises_are_not_spikes(tmp_path: Path) -> None:
    # rtol=2: a rise must be at least 2x the mean away from it; 0.5 -> 1.2 is not (mean 0.75, 0.45 < 1.5)
    assert _run(SpikeDetection(exclude_batches_path=tmp_path), [1.0, 0.5, 1.2, 1.0, 0.9]) is None
    assert _run(SpikeDetection(exclude_batches_path=tmp_path, mode="max"), [1.0, 2.0, 30.0, 40.0]) is None
    # in "max" mode a fall is what spikes
    assert _run(SpikeDetection(exclude_batches_path=tmp_path, mode="max", rtol=0.5), [10.0, 11.0, 1.0]) == 2


def test_warmup_atol_and_window(tmp_path: Path) -> None:
    path = tmp_path / "skip.json"
    assert _run(SpikeDetection(exclude_batches_path=path, warmup=3), [1.0, 9.0, 1.0]) is None
    assert _run(SpikeDetection(exclude_batches_path=path, warmup=1), [1.0, 9.0, 1.0]) == 1
    assert path.exists()  # a path ending in .json is the file itself
    # atol and rtol must both be exceeded
    assert _run(SpikeDetection(exclude_batches_path=path, atol=10.0), [1.0, 9.0]) is None
    assert _run(SpikeDetection(exclude_batches_path=path, atol=1.0, rtol=None), [1.0, 2.5]) == 1
    # the mean covers only the last `window` losses: after 10,10,1,1 a window of 2 sees mean 1, so 5 spikes
    assert _run(SpikeDetection(exclude_batches_path=path, window=2), [10.0, 10.0, 1.0, 1.0, 5.0]) == 4
    assert _run(SpikeDetection(exclude_batches_path=path, window=10), [10.0, 10.0, 1.0, 1.0, 5.0]) is None


def test_non_finite_losses(tmp_path: Path) -> None:
    assert _run(SpikeDetection(exclude_batches_path=tmp_path), [1.0, float("nan")]) == 1
    # finite_only=False: NaN is no spike and stays out of the mean (which would otherwise be NaN forever)
    detector = SpikeDetection(exclude_batches_path=tmp_path, finite_only=False)
    assert _run(detector, [1.0, float("nan"), 1.0, 9.0]) == 3


def test_default_file_is_skip_batches_json_in_the_working_directory(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    assert _run(SpikeDetection(), [1.0, 9.0]) == 1
    assert json.loads((tmp_path / "skip_batches.json").read_text()) == [0, 1]


def test_one_collective_per_batch_when_only_finite_losses_count(tmp_path: Path) -> None:
    fabric: Any = _OneRank()
    detector = SpikeDetection(exclude_batches_path=tmp_path)
    for batch_idx in range(3):
        detector.on_train_batch_end(fabric, torch.tensor(1.0), None, batch_idx)
    assert fabric.decisions == [(False, False)] * 3  # "any rank spiked?", nothing else


def test_state_dict_round_trip_keeps_the_mean(tmp_path: Path) -> None:
    detector = SpikeDetection(exclude_batches_path=tmp_path, window=2)
    _run(detector, [10.0, 1.0, 1.0])
    resumed = SpikeDetection()
    resumed.load_state_dict(detector.state_dict())
    assert resumed.last_val == 1.0 and resumed.window == 2
    fabric: Any = _OneRank()
    with pytest.raises(TrainingSpikeException):
        resumed.on_train_batch_end(fabric, torch.tensor(5.0), None, 3)


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match=r"mode='avg'.*Pass mode='min' or mode='max'"):
        SpikeDetection(mode="avg")  # type: ignore[arg-type]


@pytest.mark.multiprocess
@pytest.mark.usefixtures("no_cluster_env")
def test_a_spike_on_one_rank_stops_both_ranks_and_the_private_collective_helpers_reduce(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=180, env=env
    )
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report == {
            "stopped_at": [5, "Training spike detected in batch 5"], "bad_batches": [4, 5],
            "sum": 3.0, "mean": 1.5, "gathered": [1.0, 2.0],
        }  # fmt: skip
    assert json.loads((tmp_path / "skip" / "skip_batches.json").read_text()) == [4, 5]  # written by rank 0

"""Every example in examples/ runs as `__main__` (as a script on 2 CPU processes for most) and does what it says.

Each run costs seconds of process start-up on a small machine, so each example runs once or twice with few
steps, and the checks read what it printed or wrote. The one example without fabric, raw_pytorch.py (no
launch, no process group), runs as `__main__` inside pytest's own process instead, which already has torch.
"""

from __future__ import annotations

import csv
import difflib
import os
import re
import runpy
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("no_cluster_env")]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    def check(self) -> Run:
        assert self.returncode == 0, (
            f"exit code {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"
        )
        return self


def run_example(args: list[str], cwd: Path, timeout: float = 120) -> Run:
    """`python ARGS` in its own session (so a hung run's processes can all be ended); fails the test on timeout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FABRIC_")}
    # Two ranks share two cores: one thread each avoids oversubscription that makes CPU training crawl.
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen(
        [sys.executable, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"python {' '.join(args)} did not finish in {timeout} s\n{stdout}\n{stderr}")
    return Run(proc.returncode, stdout, stderr)


def floats(pattern: str, text: str) -> list[float]:
    return [float(value) for value in re.findall(pattern, text)]


# -- 1. the conversion pair -------------------------------------------------------------------------


def _code_lines(path: Path) -> list[str]:
    """The file's lines after its module docstring (the docstrings differ on purpose)."""
    lines = path.read_text().splitlines()
    end = next(i for i in range(1, len(lines)) if lines[i].endswith('"""'))
    return lines[end + 1 :]


def test_conversion_diff_is_the_five_fabric_lines_and_the_import() -> None:
    raw = _code_lines(EXAMPLES / "convert" / "raw_pytorch.py")
    converted = _code_lines(EXAMPLES / "convert" / "with_fabric.py")
    diff = [line for line in difflib.ndiff(raw, converted) if line[:2] in ("- ", "+ ")]
    removed = [line[2:].strip() for line in diff if line.startswith("- ")]
    added = [line[2:].split("  #")[0].strip() for line in diff if line.startswith("+ ")]
    assert removed == [
        "loader = DataLoader(make_data(), batch_size=args.batch_size, shuffle=True)",
        "loss.backward()",
    ]
    assert added == [
        "",
        "from fabric import Fabric",
        "fabric = Fabric()",
        "fabric.launch()",
        "model, optimizer = fabric.setup(model, optimizer)",
        "loader = fabric.setup_dataloaders(DataLoader(make_data(), batch_size=args.batch_size, shuffle=True))",
        "fabric.backward(loss)",
    ]


def test_conversion_pair_trains_raw_and_on_two_processes_with_fabric(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    raw_script = str(EXAMPLES / "convert" / "raw_pytorch.py")
    monkeypatch.setattr(sys, "argv", [raw_script, "--epochs", "2"])
    with torch.random.fork_rng():  # the script seeds torch's global generator: give pytest's back unchanged
        runpy.run_path(raw_script, run_name="__main__")
    raw_stdout = capsys.readouterr().out
    raw_losses = floats(r"epoch \d: loss ([0-9.]+)", raw_stdout)
    assert len(raw_losses) == 2 and raw_losses[1] < raw_losses[0], raw_stdout

    command = ["-m", "fabric", "run", "--accelerator", "cpu", "--devices", "2"]
    converted = run_example([*command, str(EXAMPLES / "convert" / "with_fabric.py"), "--epochs", "2"], tmp_path)
    converted.check()
    # Every process runs the loop on its own half of the data and prints its own loss.
    first, second = (floats(rf"epoch {e}: loss ([0-9.]+)", converted.stdout) for e in (0, 1))
    assert len(first) == len(second) == 2, converted.stdout
    assert max(second) < min(first), converted.stdout


# -- 2. image classifier: train, evaluate, checkpoint, resume ---------------------------------------


def test_image_classifier_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    script = str(EXAMPLES / "image_classifier.py")
    first = run_example([script, "--accelerator", "cpu", "--devices", "2", "--epochs", "1"], tmp_path).check()
    (accuracy,) = floats(r"epoch 0: train loss [0-9.]+, val acc ([0-9.]+)", first.stdout)
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()

    # Resume on one process: the restored weights score exactly what they scored on two, then training goes on.
    resumed = run_example([script, "--epochs", "2", "--resume", "checkpoints/last.ckpt"], tmp_path).check()
    (restored,) = floats(r"after epoch 0: val acc ([0-9.]+)", resumed.stdout)
    # Within 2 of 512 samples: batches of a different size may round a near-tie differently; a failed restore
    # would score near chance (0.1) instead.
    assert restored == pytest.approx(accuracy, abs=2 / 512), resumed.stdout
    assert not re.search(r"^epoch 0:", resumed.stdout, re.MULTILINE), resumed.stdout
    (final,) = floats(r"epoch 1: train loss [0-9.]+, val acc ([0-9.]+)", resumed.stdout)
    assert final > max(accuracy, 0.3), resumed.stdout  # 10 classes: chance is 0.1


# -- 3. language model ----------------------------------------------------------------------------


def test_language_model_loss_goes_down_and_it_samples_text(tmp_path: Path) -> None:
    args = ["--max-steps", "30", "--log-every", "10", "--batch-size", "16", "--block", "32", "--sample-chars", "20"]
    run = run_example([str(EXAMPLES / "language_model.py"), *args], tmp_path).check()
    losses = floats(r"step \d+: loss ([0-9.]+)", run.stdout)
    assert len(losses) == 4, run.stdout  # steps 0, 10, 20 and the last one, 29
    assert losses[-1] < 0.6 * losses[0], run.stdout
    (sample,) = re.findall(r"sample: (.*)", run.stdout)
    assert sample.startswith("the ") and len(sample) == 4 + 20, run.stdout


def test_pipeline_gpt_loss_goes_down_on_two_stages(tmp_path: Path) -> None:
    # 11 steps: the loss at step 10 is under half of step 0's (about 1.41 against 3.08 here).
    args = ["--devices", "2", "--max-steps", "11", "--log-every", "5"]
    run = run_example([str(EXAMPLES / "pipeline_gpt.py"), *args], tmp_path).check()
    losses = floats(r"step \d+: loss ([0-9.]+)", run.stdout)
    assert len(losses) == 3, run.stdout  # steps 0, 5 and 10
    assert losses[-1] < 0.6 * losses[0], run.stdout


# -- 4. GAN ---------------------------------------------------------------------------------------


def test_gan_generator_moves_towards_the_data_on_two_processes(tmp_path: Path) -> None:
    args = ["--accelerator", "cpu", "--devices", "2", "--epochs", "2"]
    run = run_example([str(EXAMPLES / "gan.py"), *args], tmp_path).check()
    distances = floats(r"mode distance ([0-9.]+)", run.stdout)
    assert len(distances) == 3, run.stdout  # before training, then one per epoch
    assert distances[-1] < 0.8 * distances[0], run.stdout
    assert len(re.findall(r"loss_d [0-9.]+, loss_g [0-9.]+", run.stdout)) == 2, run.stdout


# -- 5. gradient accumulation ----------------------------------------------------------------------


def test_gradient_accumulation_syncs_only_on_the_last_micro_batch(tmp_path: Path) -> None:
    args = ["--accelerator", "cpu", "--devices", "2", "--epochs", "2", "--accumulate", "4"]
    run = run_example([str(EXAMPLES / "gradient_accumulation.py"), *args], tmp_path).check()
    synced = re.findall(r"micro-batch (\d) of the first step: gradients equal on all ranks: (True|False)", run.stdout)
    assert synced == [("0", "False"), ("1", "False"), ("2", "False"), ("3", "True")], run.stdout
    # 4096 samples / 2 ranks / 16 per micro-batch = 128 micro-batches per epoch = 32 optimizer steps.
    assert "(64 optimizer steps so far)" in run.stdout, run.stdout
    losses = floats(r"epoch \d: loss ([0-9.]+)", run.stdout)
    assert len(losses) == 2 and losses[1] < losses[0], run.stdout
    assert "weights equal on all 2 ranks: True" in run.stdout


# -- 6. k-fold cross-validation --------------------------------------------------------------------


def test_kfold_trains_a_fresh_model_per_fold(tmp_path: Path) -> None:
    run = run_example([str(EXAMPLES / "kfold.py"), "--folds", "3", "--epochs", "1"], tmp_path).check()
    folds = floats(r"fold \d: val acc ([0-9.]+) \(800 train, 400 val samples\)", run.stdout)
    assert len(folds) == 3, run.stdout
    (mean,) = floats(r"3-fold cross-validation: mean val acc ([0-9.]+)", run.stdout)
    assert mean == pytest.approx(sum(folds) / 3, abs=1e-3)
    assert mean > 0.5, run.stdout  # 3 classes: chance is 0.33


# -- 7. build your own trainer ---------------------------------------------------------------------


def test_trainer_logs_checkpoints_shows_one_progress_bar_and_resumes(tmp_path: Path) -> None:
    script = str(EXAMPLES / "build_your_own_trainer" / "run.py")
    run = run_example([script, "--accelerator", "cpu", "--devices", "2", "--max-epochs", "2"], tmp_path).check()
    assert len(re.findall(r"epoch \d: train_loss [0-9.]+, val_loss [0-9.]+, val_acc [0-9.]+", run.stdout)) == 2
    # 2048 samples / 2 ranks / 32 = 32 batches: one bar per epoch, from rank 0 only (tqdm draws "0/32" once per
    # bar). Validation (2 batches per rank) is too short to get one.
    assert run.stderr.count("| 0/32 [") == 2, run.stderr
    assert "Validation" not in run.stderr

    rows = list(csv.DictReader((tmp_path / "logs" / "trainer" / "version_0" / "metrics.csv").open()))
    train_rows = [row for row in rows if row["train_loss"]]
    val_losses = [float(row["val_loss"]) for row in rows if row["val_loss"]]
    assert len(train_rows) == 6 and len(val_losses) == 2, rows  # a train row every 10 of 64 steps
    assert val_losses[1] < val_losses[0]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["epoch-001.ckpt", "epoch-002.ckpt"]

    resumed = run_example([script, "--max-epochs", "3", "--resume", "--no-progress-bar"], tmp_path).check()
    assert "resumed from checkpoints/epoch-002.ckpt (epoch 2, step 64)" in resumed.stdout
    assert re.findall(r"epoch (\d): train_loss", resumed.stdout) == ["2"], resumed.stdout
    assert (tmp_path / "checkpoints" / "epoch-003.ckpt").is_file()

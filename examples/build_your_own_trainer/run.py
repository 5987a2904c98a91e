"""Train a small classifier with the Trainer from trainer.py: callbacks, CSV logs, checkpoints, a progress bar.

Run:  python examples/build_your_own_trainer/run.py --accelerator cpu --devices 2
      python examples/build_your_own_trainer/run.py --accelerator cpu --devices 2 --max-epochs 6 --resume
      python examples/build_your_own_trainer/run.py --accelerator cuda --devices 2 --precision bf16-mixed
Metrics go to logs/trainer/version_N/metrics.csv, checkpoints to checkpoints/epoch-NNN.ckpt.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from trainer import StepModule, Trainer

from fabric import seed_everything
from fabric.loggers import CSVLogger


class Classifier(StepModule):
    def __init__(self, features: int = 32, classes: int = 4, lr: float = 1e-2) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, classes))
        self.lr = lr

    def forward(self, batch: tuple[Tensor, Tensor]) -> dict[str, Tensor]:
        x, y = batch
        logits = self.net(x)
        accuracy = (logits.argmax(dim=1) == y).float().mean()
        return {"loss": nn.functional.cross_entropy(logits, y), "acc": accuracy}

    def configure_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class EarlyStopping:
    """Stop when the validation loss has not improved by `min_delta` for `patience` validations."""

    def __init__(self, patience: int = 3, min_delta: float = 1e-3) -> None:
        self.patience = patience
        self.min_delta = min_delta
        self.best = float("inf")
        self.bad = 0

    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        # Every process holds the same all-reduced metrics, so all of them decide the same way.
        if metrics["val_loss"] < self.best - self.min_delta:
            self.best, self.bad = metrics["val_loss"], 0
        else:
            self.bad += 1
        if self.bad >= self.patience:
            trainer.fabric.print(f"early stopping: val_loss has not improved for {self.patience} validations")
            trainer.should_stop = True


class PrintEpoch:
    """One summary line per epoch (on rank 0 of each machine)."""

    def on_train_epoch_end(self, trainer: Trainer, epoch: int, metrics: dict[str, float]) -> None:
        self._train = metrics

    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        train = getattr(self, "_train", {})
        trainer.fabric.print(
            f"epoch {trainer.epoch}: train_loss {train.get('loss', float('nan')):.4f}, "
            f"val_loss {metrics['val_loss']:.4f}, val_acc {metrics['val_acc']:.4f}"
        )


def make_data(n: int, seed: int, features: int = 32, classes: int = 4) -> TensorDataset:
    """Noisy linearly separable data; the labelling weights are the same for every seed."""
    w = torch.randn(features, classes, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=generator)
    return TensorDataset(x, (x @ w + 0.5 * torch.randn(n, classes, generator=generator)).argmax(dim=1))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Defaults that leave the choice to fabric (and to `fabric run`): 1 process on a CPU, every GPU on a GPU machine.
    parser.add_argument("--accelerator", default="auto", help="cpu, cuda, gpu, mps or auto")
    parser.add_argument("--strategy", default="auto", help="e.g. ddp, ddp_spawn; auto: ddp for several devices")
    parser.add_argument("--devices", default="auto", help="how many devices (processes on a CPU)")
    parser.add_argument("--precision", default=None, help="e.g. bf16-mixed, 16-mixed; default: 32-true")
    parser.add_argument("--max-epochs", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--log-dir", type=Path, default=Path("logs"))
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    parser.add_argument("--no-progress-bar", action="store_true")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    trainer = Trainer(
        accelerator=args.accelerator,
        strategy=args.strategy,
        devices=args.devices,
        precision=args.precision,
        callbacks=[PrintEpoch(), EarlyStopping()],
        loggers=[CSVLogger(args.log_dir, name="trainer", flush_logs_every_n_steps=20)],
        checkpoint_dir=args.checkpoint_dir,
        progress_bar=not args.no_progress_bar,
        max_epochs=args.max_epochs,
        max_steps=args.max_steps,
    )
    seed_everything(42)
    train = DataLoader(make_data(2048, seed=1), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(make_data(512, seed=2), batch_size=128)
    trainer.fit(Classifier(), train, val, resume=args.resume)
    if trainer.fabric.is_global_zero:
        print(f"metrics: {trainer.fabric.logger.log_dir}/metrics.csv")


if __name__ == "__main__":
    main()

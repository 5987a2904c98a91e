"""A small, reusable Trainer on top of fabric: epochs, validation, callbacks, CSV logging, checkpoints, progress bar.

Copy it and change what you need; run.py shows how to use it. A model for this Trainer is a `StepModule`: its
`forward(batch)` does the whole step and returns a dict of metrics with a "loss". Calls to the model go through
fabric's wrapper (DDP's gradient sync and the precision's autocast); so would a `training_step` method (fabric
routes it like forward) or any method marked with `model.mark_forward_method(name)`, but one entry point keeps
this Trainer short.

Callbacks are plain objects with any of these methods, called through `fabric.call` with keyword arguments:
    on_train_start(trainer)                 on_train_end(trainer)
    on_train_epoch_start(trainer, epoch)    on_train_epoch_end(trainer, epoch, metrics)
    on_train_batch_end(trainer, metrics, batch_idx)
    on_validation_end(trainer, metrics)
A callback stops training by setting `trainer.should_stop = True`. It must decide the same on every process
(from all-reduced metrics, as the validation metrics are): a process that stops alone leaves the others waiting.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Sized
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from fabric import Fabric
from fabric.loggers import Logger

CHECKPOINT_GLOB = "epoch-*.ckpt"


class StepModule(nn.Module):
    """The model interface: `forward(batch)` returns {"loss": ..., other metrics}; it owns its optimizer."""

    def forward(self, batch: Any) -> dict[str, Tensor]:
        raise NotImplementedError

    def configure_optimizer(self) -> torch.optim.Optimizer:
        raise NotImplementedError


class Trainer:
    """Runs `fit(model, train_loader, val_loader)` with fabric; every argument has a small default."""

    def __init__(
        self,
        *,
        accelerator: str = "auto",
        strategy: str = "auto",
        devices: int | str = "auto",
        precision: str | None = None,
        callbacks: Sequence[Any] = (),
        loggers: Sequence[Logger] = (),
        max_epochs: int = 10,
        max_steps: int | None = None,
        validation_every_n_epochs: int = 1,
        log_every_n_steps: int = 10,
        checkpoint_dir: str | Path | None = "checkpoints",
        progress_bar: bool = True,
        progress_bar_min_batches: int = 10,
    ) -> None:
        self.fabric = Fabric(
            accelerator=accelerator,
            strategy=strategy,
            devices=devices,
            precision=precision,
            callbacks=list(callbacks),
            loggers=list(loggers),
        )
        # Here rather than in fit(): with strategy "ddp" this re-runs the script for the other ranks, which
        # then build the same model and data as this one.
        self.fabric.launch()
        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self.validation_every_n_epochs = validation_every_n_epochs
        self.log_every_n_steps = log_every_n_steps
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.progress_bar = progress_bar
        self.progress_bar_min_batches = progress_bar_min_batches
        self.epoch = 0  # the next epoch to run
        self.global_step = 0  # optimizer steps taken
        self.should_stop = False

    def fit(
        self, model: StepModule, train_loader: DataLoader, val_loader: DataLoader | None = None, resume: bool = False
    ) -> None:
        """Train for `max_epochs` (or `max_steps`); with `resume`, continue from the newest checkpoint."""
        fabric = self.fabric
        optimizer = model.configure_optimizer()
        model, optimizer = fabric.setup(model, optimizer)
        train = fabric.setup_dataloaders(train_loader)
        val = fabric.setup_dataloaders(val_loader) if val_loader is not None else None
        state = {"model": model, "optimizer": optimizer, "trainer": {}}
        if resume:
            self._resume(state)

        fabric.call("on_train_start", trainer=self)
        while not self._done():
            fabric.call("on_train_epoch_start", trainer=self, epoch=self.epoch)
            metrics = self._train_epoch(model, optimizer, train)
            fabric.call("on_train_epoch_end", trainer=self, epoch=self.epoch, metrics=metrics)
            if val is not None and (self.epoch + 1) % self.validation_every_n_epochs == 0:
                self.validate(model, val)
            self.epoch += 1
            self._save(state)
        fabric.call("on_train_end", trainer=self)
        if fabric.is_global_zero:  # only rank 0 logs, so only its loggers hold anything to write
            for logger in fabric.loggers:
                logger.finalize("success")

    def _done(self) -> bool:
        steps_done = self.max_steps is not None and self.global_step >= self.max_steps
        return self.should_stop or steps_done or self.epoch >= self.max_epochs

    def _train_epoch(self, model: nn.Module, optimizer: torch.optim.Optimizer, loader: Iterable) -> dict[str, float]:
        fabric = self.fabric
        model.train()
        sums: dict[str, Tensor] = {}
        batches = 0
        for batch_idx, batch in enumerate(self._progress(loader, f"Epoch {self.epoch}")):
            metrics = model(batch)
            optimizer.zero_grad()
            fabric.backward(metrics["loss"])
            optimizer.step()
            self.global_step += 1
            batches += 1
            detached = {name: value.detach() for name, value in metrics.items()}
            for name, value in detached.items():
                sums[name] = sums.get(name, 0) + value
            fabric.call("on_train_batch_end", trainer=self, metrics=detached, batch_idx=batch_idx)
            if self.global_step % self.log_every_n_steps == 0:
                fabric.log_dict({f"train_{k}": v for k, v in detached.items()} | {"epoch": self.epoch},
                                step=self.global_step)  # fmt: skip
            if self._done():
                break
        # The epoch's mean over every process: each one trained on its own shard.
        return _as_floats(fabric.all_reduce({k: v / max(batches, 1) for k, v in sums.items()}, reduce_op="mean"))

    @torch.no_grad()
    def validate(self, model: nn.Module, loader: Iterable) -> dict[str, float]:
        """Mean of each metric over the validation set (weighted by batches, averaged over processes)."""
        model.eval()
        sums: dict[str, Tensor] = {}
        batches = torch.zeros((), device=self.fabric.device)
        for batch in self._progress(loader, f"Validation {self.epoch}"):
            for name, value in model(batch).items():
                sums[name] = sums.get(name, 0) + value.detach().float()
            batches += 1
        totals = self.fabric.all_reduce({"batches": batches, **sums}, reduce_op="sum")
        count = totals.pop("batches")
        metrics = _as_floats({f"val_{k}": v / count for k, v in totals.items()})
        self.fabric.log_dict(metrics | {"epoch": self.epoch}, step=self.global_step)
        self.fabric.call("on_validation_end", trainer=self, metrics=metrics)
        model.train()
        return metrics

    def _progress(self, loader: Iterable, description: str) -> Iterable:
        """A tqdm bar on global rank 0 for loops long enough to need one; the plain loader otherwise."""
        length = len(loader) if isinstance(loader, Sized) else 0
        show = self.progress_bar and self.fabric.is_global_zero and length >= self.progress_bar_min_batches
        return tqdm(loader, desc=description, dynamic_ncols=True) if show else loader

    # -- checkpoints ------------------------------------------------------------------------------
    def _save(self, state: dict[str, Any]) -> None:
        if self.checkpoint_dir is None:
            return
        state["trainer"] = {"epoch": self.epoch, "global_step": self.global_step}
        # Named by the number of finished epochs: epoch-001.ckpt holds the state after the first epoch.
        self.fabric.save(self.checkpoint_dir / f"epoch-{self.epoch:03d}.ckpt", state)

    def _resume(self, state: dict[str, Any]) -> None:
        # Rank 0 picks the file and tells the others, so every process loads the same one even if their views
        # of a shared directory differ for a moment.
        newest = self.fabric.broadcast(self._newest_checkpoint())
        if newest is None:
            self.fabric.print(f"resume: no checkpoint in {self.checkpoint_dir}; starting from scratch")
            return
        self.fabric.load(newest, state)
        self.epoch = state["trainer"]["epoch"]
        self.global_step = state["trainer"]["global_step"]
        self.fabric.print(f"resumed from {newest} (epoch {self.epoch}, step {self.global_step})")

    def _newest_checkpoint(self) -> str | None:
        if self.checkpoint_dir is None or not self.checkpoint_dir.is_dir():
            return None
        found = sorted(self.checkpoint_dir.glob(CHECKPOINT_GLOB))
        return str(found[-1]) if found else None


def _as_floats(metrics: Mapping[str, Tensor]) -> dict[str, float]:
    return {name: float(value) for name, value in metrics.items()}

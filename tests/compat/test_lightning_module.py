"""A LightningModule set up with our Fabric: its self.log, self.logger, self.print, ... reach our Fabric and loggers."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric
from fabric.loggers import Logger

L = pytest.importorskip("lightning", reason="lightning is not installed (pip install torchfabric[lightning])")


class MemoryLogger(Logger):
    """Keeps every logged metric in memory."""

    def __init__(self) -> None:
        self.metrics: list[tuple[dict[str, float], int | None]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append((dict(metrics), step))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class Policy(L.LightningModule):
    """An RL-style module: logs through self.log, self.log_dict and self.logger, steps its own optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Linear(4, 2)
        self.seen: dict[str, Any] = {}
        self.hook_calls: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        optimizer = self.optimizers()
        loss = self(x).pow(2).mean()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        self.log("train/loss", loss)
        self.log_dict({"train/batch": float(batch_idx), "train/ones": torch.tensor(1.0)})
        self.logger.log_metrics({"custom": 2.0 * batch_idx}, step=batch_idx)
        self.seen.update(
            device=self.device,
            dtype=self.dtype,
            loggers=list(self.loggers),
            gathered=self.all_gather(torch.tensor([float(batch_idx)])),
            optimizer=optimizer,
        )
        return loss

    def on_train_epoch_end(self) -> None:
        self.hook_calls.append("on_train_epoch_end")
        self.print("epoch done")

    def on_after_optimizer_step(self, strategy: Any, optimizer: Any) -> None:
        self.hook_calls.append("on_after_optimizer_step")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightning_module_logs_through_our_fabric_and_loggers(capsys: pytest.CaptureFixture[str]) -> None:
    logger = MemoryLogger()
    fabric = Fabric(accelerator="cpu", devices=1, loggers=logger)
    module = Policy()
    model, optimizer = fabric.setup(module, module.configure_optimizers())
    assert module._fabric is fabric and module.fabric is fabric
    assert module._fabric_optimizers == [optimizer]
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.randn(6, 4)), batch_size=2))
    before = module.net.weight.detach().clone()
    for batch_idx, batch in enumerate(loader):
        model.training_step(batch, batch_idx)
    fabric.call("on_train_epoch_end")

    assert not torch.equal(before, module.net.weight), "the optimizer returned by self.optimizers() did not step"
    logged = logger.metrics
    assert [m for m, _ in logged if "train/loss" in m] and all(
        isinstance(m["train/loss"], float) for m, _ in logged if "train/loss" in m
    )
    assert ({"train/batch": 2.0, "train/ones": 1.0}, None) in logged
    assert [(m, s) for m, s in logged if "custom" in m] == [({"custom": 0.0}, 0), ({"custom": 2.0}, 1),
                                                            ({"custom": 4.0}, 2)]  # fmt: skip
    assert module.seen["device"] == torch.device("cpu") and module.seen["dtype"] == torch.float32
    assert module.seen["loggers"] == [logger]
    assert module.seen["optimizer"] is optimizer
    assert torch.equal(module.seen["gathered"], torch.tensor([2.0]))
    assert module.hook_calls == ["on_after_optimizer_step"] * 3 + ["on_train_epoch_end"]
    assert capsys.readouterr().out.count("epoch done") == 1


def test_lightning_module_dtype_and_device_follow_the_precision() -> None:
    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-true")
    module = Policy()
    model = fabric.setup_module(module)
    assert module._fabric is fabric
    assert (module.device, module.dtype) == (torch.device("cpu"), torch.bfloat16)
    assert (model.device, model.dtype) == (torch.device("cpu"), torch.bfloat16)


def test_self_log_rejects_what_lightning_rejects() -> None:
    fabric = Fabric(accelerator="cpu", devices=1, loggers=MemoryLogger())
    module = Policy()
    fabric.setup(module)
    with pytest.raises(ValueError, match="nested dictionaries cannot be logged"):
        module.log_dict({"a": {"b": 1.0}})


def test_plain_module_setup_does_not_import_lightning() -> None:
    code = (
        "import sys, torch\n"
        "from fabric import Fabric\n"
        "f = Fabric(accelerator='cpu', devices=1)\n"
        "m = torch.nn.Linear(2, 2)\n"
        "m, o = f.setup(m, torch.optim.SGD(m.parameters(), lr=0.1))\n"
        "m(torch.ones(1, 2)).sum().backward(); o.step(); f.call('on_train_end'); f.log('x', 1.0)\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in ('lightning', 'lightning_fabric')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"

"""Attaching a Fabric to a LightningModule that is set up with it, so its `self.log`, `self.logger`, ... work.

A LightningModule routes `self.log`, `self.log_dict`, `self.logger(s)`, `self.all_gather`, `self.print`,
`self.optimizers()` and `self.manual_backward` to the object in its `_fabric` attribute when that is set, calling
only Fabric's public API (`log_dict(metrics=...)`, `logger`, `loggers`, `strategy.all_gather`, `backward`,
`is_global_zero`). Nothing here imports lightning: the module is recognised by that attribute, the way Lightning
Fabric recognises it, so `import fabric` stays free of it.
"""

from __future__ import annotations

from typing import Any

from torch.nn import Module


def is_lightning_module(module: Module) -> bool:
    """Whether `module` takes a Fabric the way a LightningModule does (it has a `_fabric` attribute)."""
    return hasattr(module, "_fabric")


def attach(module: Module, fabric: Any, callbacks: list[Any], optimizers: list[Any] | None) -> None:
    """Give a LightningModule its Fabric (and, from setup(), its optimizers); make its hooks callbacks."""
    if not is_lightning_module(module):
        return
    # Plain attributes, not the `fabric` property: that one stores a weak proxy, and Lightning Fabric sets the
    # attribute itself too.
    # setattr: Module.__setattr__'s type hints only allow tensors and modules.
    setattr(module, "_fabric", fabric)  # noqa: B010
    if optimizers is not None:
        setattr(module, "_fabric_optimizers", optimizers)  # noqa: B010
    # The module's own hooks (on_train_epoch_end, on_after_optimizer_step, ...) then run on fabric.call.
    if not any(callback is module for callback in callbacks):
        callbacks.append(module)

"""Loss-spike detection (Lightning's ``SpikeDetection``): stop training when the loss jumps away from its mean.

Call ``detector.on_train_batch_end(fabric, loss, batch, batch_idx)`` after each step (or pass the object in
``Fabric(callbacks=[...])`` and ``fabric.call("on_train_batch_end", ...)``). On a spike it writes the current
and the previous batch index to a JSON file (to skip them on resume) and raises ``TrainingSpikeException``.
"""

from __future__ import annotations

import json
import math
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from fabric.utilities.exceptions import FabricValueError
from fabric.utilities.types import _PATH

if TYPE_CHECKING:
    from fabric.fabric import Fabric


class TrainingSpikeException(RuntimeError):
    """Raised by ``SpikeDetection`` when the loss spiked at ``batch_idx``."""

    def __init__(self, batch_idx: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(f"Training spike detected in batch {batch_idx}", *args, **kwargs)


class SpikeDetection:
    """Raise ``TrainingSpikeException`` when the loss moves away from its running mean in the wrong direction.

    Args:
        mode: ``"min"`` if the loss should fall, ``"max"`` if it should rise.
        window: how many recent losses the running mean covers.
        warmup: batches before ``warmup`` are never checked.
        atol: a spike must differ from the running mean by at least this much (None: no absolute bound).
        rtol: ... and by at least ``rtol * running_mean`` (None: no relative bound).
        exclude_batches_path: directory (or ``.json`` file) for the batches to skip; the current directory
            by default.
        finite_only: True: a NaN/inf loss is a spike. False: it is not, and it is kept out of the mean.
    """

    def __init__(
        self,
        mode: Literal["min", "max"] = "min",
        window: int = 10,
        warmup: int = 1,
        atol: float | None = None,
        rtol: float | None = 2.0,
        exclude_batches_path: _PATH | None = None,
        finite_only: bool = True,
    ) -> None:
        if mode not in ("min", "max"):
            raise FabricValueError(
                f"SpikeDetection(mode={mode!r}): the mode says whether the loss should fall or rise. "
                "Pass mode='min' or mode='max'."
            )
        self.mode = mode
        self.window = window
        self.warmup = warmup
        self.atol = atol
        self.rtol = rtol
        self.exclude_batches_path = exclude_batches_path
        self.finite_only = finite_only
        self.last_val: float = 0.0
        self.bad_batches: list[int] = []
        self._recent: deque[float] = deque(maxlen=window)

    @torch.no_grad()
    def on_train_batch_end(self, fabric: Fabric, loss: torch.Tensor, batch: Any, batch_idx: int) -> None:
        """Check this rank's ``loss``; a spike on any rank stops every rank (one collective per call)."""
        self.exclude_batches_path = self._file()
        value = float(loss.detach().float().mean()) if isinstance(loss, torch.Tensor) else float(loss)
        spiked = batch_idx >= self.warmup and self._is_spike(value)
        if fabric.strategy.reduce_boolean_decision(spiked, all=False):
            self._handle_spike(fabric, batch_idx)
        # With finite_only=False a non-finite loss on any rank is kept out of every rank's mean.
        if self.finite_only or fabric.strategy.reduce_boolean_decision(math.isfinite(value), all=True):
            self._recent.append(value)
            self.last_val = value

    def _file(self) -> str:
        path = Path(self.exclude_batches_path if self.exclude_batches_path is not None else Path.cwd())
        return str(path if path.name.endswith(".json") else path / "skip_batches.json")

    def _is_spike(self, value: float) -> bool:
        if not math.isfinite(value):
            return self.finite_only
        if not self._recent:  # no mean yet: nothing to compare with
            return False
        diff = value - self.last_val
        if (diff <= 0) if self.mode == "min" else (diff >= 0):  # moved the right way: never a spike
            return False
        mean = sum(self._recent) / len(self._recent)
        deviation = abs(value - mean)
        return (self.atol is None or deviation >= abs(self.atol)) and (
            self.rtol is None or deviation >= abs(self.rtol * mean)
        )

    def _handle_spike(self, fabric: Fabric, batch_idx: int) -> None:
        # The previous batch may have corrupted the weights that made this one spike: skip both.
        self.bad_batches.extend([batch_idx - 1, batch_idx])
        if fabric.global_rank == 0:
            path = Path(str(self.exclude_batches_path))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.bad_batches, indent=4))
        raise TrainingSpikeException(batch_idx=batch_idx)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue detecting after a resume."""
        return {
            "last_val": self.last_val,
            "mode": self.mode,
            "warmup": self.warmup,
            "atol": self.atol,
            "rtol": self.rtol,
            "bad_batches": list(self.bad_batches),
            "bad_batches_path": self.exclude_batches_path,
            "window": self.window,
            "recent": list(self._recent),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.last_val = state_dict["last_val"]
        self.mode = state_dict["mode"]
        self.warmup = state_dict["warmup"]
        self.atol = state_dict["atol"]
        self.rtol = state_dict["rtol"]
        self.bad_batches = list(state_dict["bad_batches"])
        self.exclude_batches_path = state_dict["bad_batches_path"]
        self.window = state_dict.get("window", self.window)
        self._recent = deque(state_dict.get("recent", []), maxlen=self.window)


__all__ = ["SpikeDetection", "TrainingSpikeException"]

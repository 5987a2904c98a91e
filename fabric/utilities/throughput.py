"""Throughput and model-FLOPs-utilisation metrics for a training loop: Throughput, ThroughputMonitor, measure_flops.

The metric names and their meaning are Lightning Fabric's, so dashboards built on them keep working.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from fabric.utilities._device_flops import _TF32, CUDA_FLOPS, chip_of
from fabric.utilities.exceptions import FabricTypeError, FabricValueError
from fabric.utilities.rank_zero import rank_zero_only, rank_zero_warn

if TYPE_CHECKING:
    from fabric.fabric import Fabric
    from fabric.precision import Precision

_Metrics = dict[str, int | float]


class _IncreasingWindow(list):
    """The last ``maxlen`` values of a counter; each appended value must exceed the previous one."""

    def __init__(self, name: str, maxlen: int) -> None:
        super().__init__()
        self.name = name
        self.maxlen = maxlen

    def append(self, value: Any) -> None:
        # A counter that stands still or goes back would give a zero or negative elapsed time or count,
        # so the rates would be infinite or negative: say so at the faulty update instead.
        if self and value <= self[-1]:
            raise FabricValueError(
                f"Throughput.update({self.name}={value}): {self.name} must be a running total that increases with "
                f"every update, but the previous update passed {self[-1]}. Pass the total since the start."
            )
        super().append(value)
        if len(self) > self.maxlen:
            del self[0]


class Throughput:
    """Rolling throughput over the last ``window_size`` updates.

    ``compute()`` always returns the totals ``time``, ``batches``, ``samples`` (and ``lengths`` when given).
    Once ``window_size`` updates were made it adds ``device/batches_per_sec``, ``device/samples_per_sec``
    (and ``device/items_per_sec`` with lengths); with ``flops`` it adds ``device/flops_per_sec`` and, when
    ``available_flops`` is known, ``device/mfu``. With ``world_size > 1`` the global ``batches_per_sec``,
    ``samples_per_sec``, ``items_per_sec`` and ``flops_per_sec`` (device values times the world size) are added.

    Args:
        available_flops: peak FLOP/s of one device, for ``device/mfu``.
        world_size: number of devices; every device is assumed to process as much as this one.
        window_size: number of updates the rates are averaged over (at least 2).
        separator: between ``device`` and the metric name.
    """

    def __init__(
        self, available_flops: float | None = None, world_size: int = 1, window_size: int = 100, separator: str = "/"
    ) -> None:
        if world_size < 1:
            raise FabricValueError(f"Throughput(world_size={world_size}): there is at least one device. Pass >= 1.")
        if window_size < 2:
            raise FabricValueError(
                f"Throughput(window_size={window_size}): a rate needs at least two updates to measure a difference. "
                "Pass window_size >= 2."
            )
        self.available_flops = available_flops
        self.world_size = world_size
        self.separator = separator
        self._time = _IncreasingWindow("time", window_size)
        self._batches = _IncreasingWindow("batches", window_size)
        self._samples = _IncreasingWindow("samples", window_size)
        self._lengths = _IncreasingWindow("lengths", window_size)
        self._flops: deque[float] = deque(maxlen=window_size)

    def update(
        self, *, time: float, batches: int, samples: int, lengths: int | None = None, flops: float | None = None
    ) -> None:
        """Record the running totals since the start of this device, and the FLOPs since the last update.

        Args:
            time: seconds elapsed since the start.
            batches: batches processed by this device so far.
            samples: samples processed by this device so far (at least ``batches``).
            lengths: items (for example tokens) processed by this device so far (at least ``samples``).
            flops: FLOPs this device ran since the previous update, e.g. ``measure_flops(...) * batches_since``.
        """
        if samples < batches:
            raise FabricValueError(
                f"Throughput.update(batches={batches}, samples={samples}): every batch holds at least one sample. "
                "Pass the sample total as samples and the batch total as batches."
            )
        if lengths is not None and lengths < samples:
            raise FabricValueError(
                f"Throughput.update(samples={samples}, lengths={lengths}): every sample has at least one item. "
                "Pass the item (token) total as lengths."
            )
        if lengths is not None and len(self._lengths) != len(self._samples):
            raise FabricValueError(
                f"Throughput.update(lengths={lengths}): earlier updates passed no lengths, so the windows would not "
                "line up. Pass lengths on every update, or on none; call reset() to start over."
            )
        self._time.append(time)
        self._batches.append(batches)
        self._samples.append(samples)
        if lengths is not None:
            self._lengths.append(lengths)
        if flops is not None:
            self._flops.append(flops * self.world_size)  # all devices together

    def compute(self) -> _Metrics:
        """The metrics described in the class docstring for the updates so far."""
        if not self._time:
            raise RuntimeError("Throughput.compute() was called before any update(). Call update() first.")
        metrics: _Metrics = {"time": self._time[-1], "batches": self._batches[-1], "samples": self._samples[-1]}
        if self._lengths:
            metrics["lengths"] = self._lengths[-1]
        if len(self._time) == self._time.maxlen:
            metrics.update(self._rates())
        if len(self._flops) == self._flops.maxlen:
            metrics.update(self._flop_rates())
        return metrics

    def _elapsed_time(self) -> float:
        return self._time[-1] - self._time[0]

    def _rates(self) -> _Metrics:
        elapsed = self._elapsed_time()
        dev = f"device{self.separator}"
        per_device = {
            "batches_per_sec": (self._batches[-1] - self._batches[0]) / elapsed,
            "samples_per_sec": (self._samples[-1] - self._samples[0]) / elapsed,
        }
        if len(self._lengths) == self._lengths.maxlen:
            per_device["items_per_sec"] = (self._lengths[-1] - self._lengths[0]) / elapsed
        metrics: _Metrics = {dev + name: value for name, value in per_device.items()}
        if self.world_size > 1:
            metrics.update({name: value * self.world_size for name, value in per_device.items()})
        return metrics

    def _flop_rates(self) -> _Metrics:
        # The first entry's FLOPs were spent before the window's first timestamp, so they are left out.
        flops_per_sec = (sum(self._flops) - self._flops[0]) / self._elapsed_time()
        device_flops_per_sec = flops_per_sec / self.world_size
        metrics: _Metrics = {f"device{self.separator}flops_per_sec": device_flops_per_sec}
        if self.world_size > 1:
            metrics["flops_per_sec"] = flops_per_sec
        if self.available_flops:
            metrics[f"device{self.separator}mfu"] = device_flops_per_sec / self.available_flops
        return metrics

    def reset(self) -> None:
        """Forget every update."""
        for window in (self._time, self._batches, self._samples, self._lengths, self._flops):
            window.clear()


class ThroughputMonitor(Throughput):
    """``Throughput`` bound to a Fabric: its world size, its device's peak FLOP/s, and ``fabric.log_dict``.

    ``update``, ``compute``, ``compute_and_log`` and ``reset`` run on global rank 0 only; elsewhere
    they do nothing (``compute`` and ``compute_and_log`` return ``{}``).

    Args:
        fabric: a launched Fabric.
        **kwargs: ``window_size`` and ``separator`` of :class:`Throughput`.
    """

    def __init__(self, fabric: Fabric, **kwargs: Any) -> None:
        fabric._validate_launched()  # before launch, world_size and device would describe the wrong process
        dtype = _plugin_to_compute_dtype(fabric.strategy.precision)
        available_flops = get_available_flops(fabric.device, dtype)
        super().__init__(available_flops=available_flops, world_size=fabric.world_size, **kwargs)
        self._fabric = fabric
        self.step = -1
        # Instance attributes shadow the methods, so subclasses' overrides are guarded too.
        self.update = rank_zero_only(self.update)  # type: ignore[method-assign]
        self.compute = rank_zero_only(self.compute, default={})  # type: ignore[method-assign]
        self.compute_and_log = rank_zero_only(self.compute_and_log, default={})  # type: ignore[method-assign]
        self.reset = rank_zero_only(self.reset)  # type: ignore[method-assign]

    def compute_and_log(self, step: int | None = None, **kwargs: Any) -> _Metrics:
        """``compute()`` and log the result with ``fabric.log_dict`` at ``step`` (default: one more than last time)."""
        self.step = self.step + 1 if step is None else step
        metrics = self.compute(**kwargs)
        self._fabric.log_dict(metrics=metrics, step=self.step)
        return metrics


def measure_flops(
    model: torch.nn.Module,
    forward_fn: Callable[[], torch.Tensor],
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> int:
    """FLOPs of one ``forward_fn()`` call, plus the loss and backward pass when ``loss_fn`` is given.

    Build the model and inputs on the meta device (``with torch.device("meta"):``) to count without
    computing or allocating anything. ``model`` is the module ``forward_fn`` runs.
    """
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        output = forward_fn()
        if loss_fn is not None:
            loss_fn(output).backward()
    return int(counter.get_total_flops())


def get_available_flops(device: torch.device, dtype: torch.dtype | str) -> int | None:
    """Peak FLOP/s of one ``device`` for ``dtype``: an upper bound that only large matmuls approach.

    Known NVIDIA GPUs only; other GPUs and dtypes give None with a warning, CPUs and MPS give None.
    """
    if device.type != "cuda":
        if device.type == "xla":
            rank_zero_warn(
                "get_available_flops: TPUs (XLA) are not supported by fabric yet, so no FLOPs are known.", stacklevel=5
            )
        return None
    name = torch.cuda.get_device_name(device)
    chip = chip_of(name)
    if chip is None:
        rank_zero_warn(
            f"get_available_flops: the peak FLOPs of {name!r} are not known, so no MFU is reported.", stacklevel=5
        )
        return None
    if dtype is torch.float32 and _uses_tf32(device):
        dtype = _TF32
    flops = CUDA_FLOPS[chip].get(dtype)
    if flops is None:
        rank_zero_warn(
            f"get_available_flops: {name!r} has no peak FLOPs for {dtype}, so no MFU is reported.", stacklevel=5
        )
        return None
    return int(flops)


def _uses_tf32(device: torch.device) -> bool:
    """Whether float32 matmuls run on TF32 tensor cores (Ampere and later, unless precision is 'highest')."""
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 8 and torch.get_float32_matmul_precision() != "highest"


# Precision plugins whose compute dtype is not given by their precision string, by class name: those
# classes live in modules with optional dependencies that must not be imported here.
def _is_instance_by_name(plugin: object, class_name: str) -> bool:
    return any(cls.__name__ == class_name for cls in type(plugin).__mro__)


def _plugin_to_compute_dtype(plugin: Precision) -> torch.dtype:
    """The dtype a precision plugin runs matmuls in, which decides the device's peak FLOP/s."""
    from fabric.precision import Precision

    if not isinstance(plugin, Precision):
        raise FabricTypeError(
            f"ThroughputMonitor: fabric.strategy.precision is a {type(plugin).__name__}, not a fabric Precision, "
            "so its compute dtype is unknown. Pass a subclass of fabric.precision.Precision."
        )
    if _is_instance_by_name(plugin, "BitsandbytesPrecision"):
        return plugin.dtype  # type: ignore[attr-defined]
    if _is_instance_by_name(plugin, "TransformerEnginePrecision"):
        return torch.int8  # Lightning's choice: FP8 matmuls are counted against the int8 peak
    precision = str(plugin.precision)
    if precision.startswith("64"):
        return torch.float64
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return torch.float32


__all__ = ["Throughput", "ThroughputMonitor", "get_available_flops", "measure_flops"]

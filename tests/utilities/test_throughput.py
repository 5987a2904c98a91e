"""Throughput, ThroughputMonitor, measure_flops and get_available_flops, used as Lightning Fabric code uses them."""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.loggers import Logger
from fabric.precision import Precision
from fabric.utilities import Throughput, ThroughputMonitor, measure_flops, rank_zero_only
from fabric.utilities.exceptions import FabricTypeError, FabricValueError
from fabric.utilities.throughput import _plugin_to_compute_dtype, get_available_flops

BATCH, IN, OUT = 8, 32, 16


class RecordingLogger(Logger):
    """Keeps every log_metrics call."""

    def __init__(self) -> None:
        self.records: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        self.records.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def linear_flops(with_backward: bool) -> int:
    """Analytic FLOPs of Linear(IN, OUT) on a (BATCH, IN) input that needs no gradient: 2*B*IN*OUT per matmul."""
    matmul = 2 * BATCH * IN * OUT
    # backward of a leaf-input Linear computes only the weight gradient (one more matmul)
    return 2 * matmul if with_backward else matmul


def test_measure_flops_of_a_linear_layer_equals_the_analytic_count() -> None:
    with torch.device("meta"):
        model = nn.Linear(IN, OUT)
        x = torch.randn(BATCH, IN)
    assert measure_flops(model, lambda: model(x)) == linear_flops(with_backward=False)
    assert measure_flops(model, lambda: model(x), lambda y: y.sum()) == linear_flops(with_backward=True)


def test_throughput_monitor_logs_the_rates_of_a_real_training_loop() -> None:
    logger = RecordingLogger()
    fabric = Fabric(accelerator="cpu", devices=1, loggers=[logger])
    fabric.launch()
    raw_model = nn.Linear(IN, OUT)
    model, optimizer = fabric.setup(raw_model, torch.optim.SGD(raw_model.parameters(), lr=0.1))
    with torch.device("meta"):
        meta_model = nn.Linear(IN, OUT)
        meta_x = torch.randn(BATCH, IN)
    flops_per_batch = measure_flops(meta_model, lambda: meta_model(meta_x), lambda y: y.sum())
    monitor = ThroughputMonitor(fabric, window_size=3)
    start = time.perf_counter()
    for step in range(1, 7):
        loss = model(torch.randn(BATCH, IN)).pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        monitor.update(
            time=time.perf_counter() - start, batches=step, samples=step * BATCH, flops=flops_per_batch
        )  # fmt: skip
        monitor.compute_and_log()
    assert [step for step, _ in logger.records] == list(range(6))
    first, last = logger.records[1][1], logger.records[-1][1]
    assert set(first) == {"time", "batches", "samples"}  # the window of 3 updates is not full yet
    assert set(last) == {
        "time", "batches", "samples", "device/batches_per_sec", "device/samples_per_sec", "device/flops_per_sec",
    }  # fmt: skip
    assert last["batches"] == 6 and last["samples"] == 6 * BATCH and last["time"] > 0
    rate = last["device/batches_per_sec"]
    assert rate > 0 and math.isfinite(rate)
    assert last["device/samples_per_sec"] == pytest.approx(BATCH * rate)
    assert last["device/flops_per_sec"] == pytest.approx(flops_per_batch * rate)
    # CPU peak FLOPs are unknown, so there is no MFU; one process, so no global rates
    assert monitor.available_flops is None


def test_throughput_rates_over_the_window_with_several_devices() -> None:
    throughput = Throughput(available_flops=100.0, world_size=2, window_size=3)
    for i in (1, 2, 3, 4):
        throughput.update(time=2.0 * i, batches=i, samples=4 * i, lengths=40 * i, flops=50)
    assert throughput.compute() == {
        "time": 8.0, "batches": 4, "samples": 16, "lengths": 160,
        # last 3 updates: 4 s, 2 batches, 8 samples, 80 items per device
        "device/batches_per_sec": 0.5, "device/samples_per_sec": 2.0, "device/items_per_sec": 20.0,
        "batches_per_sec": 1.0, "samples_per_sec": 4.0, "items_per_sec": 40.0,
        # flops after the window's first update: 2 x 50 per device, x2 devices, over 4 s
        "flops_per_sec": 50.0, "device/flops_per_sec": 25.0, "device/mfu": 0.25,
    }  # fmt: skip
    throughput.reset()
    throughput.update(time=1.0, batches=1, samples=1)
    assert throughput.compute() == {"time": 1.0, "batches": 1, "samples": 1}


def test_throughput_rejects_counters_that_do_not_increase_and_bad_arguments() -> None:
    throughput = Throughput(window_size=2)
    throughput.update(time=1.0, batches=1, samples=2)
    with pytest.raises(FabricValueError, match=r"update\(time=1.0\).*must be a running total"):
        throughput.update(time=1.0, batches=2, samples=4)
    with pytest.raises(FabricValueError, match=r"batches=3, samples=2\).*at least one sample"):
        throughput.update(time=2.0, batches=3, samples=2)
    with pytest.raises(FabricValueError, match=r"samples=4, lengths=3\).*at least one item"):
        throughput.update(time=2.0, batches=2, samples=4, lengths=3)
    with pytest.raises(FabricValueError, match=r"lengths=8\): earlier updates passed no lengths"):
        throughput.update(time=2.0, batches=2, samples=4, lengths=8)
    with pytest.raises(FabricValueError, match=r"window_size=1\).*at least two updates"):
        Throughput(window_size=1)
    with pytest.raises(FabricValueError, match=r"world_size=0\)"):
        Throughput(world_size=0)
    with pytest.raises(RuntimeError, match=r"compute\(\) was called before any update"):
        Throughput().compute()


def test_throughput_monitor_does_nothing_on_other_ranks() -> None:
    logger = RecordingLogger()
    fabric = Fabric(accelerator="cpu", devices=1, loggers=[logger])
    monitor = ThroughputMonitor(fabric, window_size=2)
    try:
        rank_zero_only.rank = 1
        monitor.update(time=1.0, batches=1, samples=1)
        assert monitor.compute_and_log() == {}
        assert monitor.compute() == {}
    finally:
        rank_zero_only.rank = None
    assert logger.records == [] and len(monitor._time) == 0


def test_throughput_monitor_before_launch_of_a_multi_process_strategy_says_to_launch() -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    with pytest.raises(RuntimeError, match=r"called before fabric.launch\(\)"):
        ThroughputMonitor(fabric)


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("32-true", torch.float32), ("64-true", torch.float64), ("16-true", torch.float16),
     ("bf16-true", torch.bfloat16), ("bf16-mixed", torch.bfloat16)],
)  # fmt: skip
def test_compute_dtype_of_our_precision_plugins(precision: str, dtype: torch.dtype) -> None:
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)  # type: ignore[arg-type]
    assert _plugin_to_compute_dtype(fabric.strategy.precision) is dtype


def test_compute_dtype_of_plugins_known_by_name_and_of_a_foreign_object() -> None:
    class BitsandbytesPrecision(Precision):
        precision = "nf4"
        dtype = torch.bfloat16

    class TransformerEnginePrecision(Precision):
        precision = "transformer-engine"

    assert _plugin_to_compute_dtype(BitsandbytesPrecision()) is torch.bfloat16
    assert _plugin_to_compute_dtype(TransformerEnginePrecision()) is torch.int8
    with pytest.raises(FabricTypeError, match=r"precision is a str, not a fabric Precision"):
        _plugin_to_compute_dtype("bf16-mixed")  # type: ignore[arg-type]


def test_available_flops_are_unknown_on_cpu_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert get_available_flops(torch.device("cpu"), torch.float32) is None


def test_available_flops_of_a_known_gpu_per_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    # CUDA faked through torch's public query functions: the lookup only reads the name and capability.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda", 0)
    assert get_available_flops(cuda, torch.bfloat16) == int(989.4e12)
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert get_available_flops(cuda, torch.float32) == int(66.9e12)
        torch.set_float32_matmul_precision("high")  # float32 matmuls on TF32 tensor cores
        assert get_available_flops(cuda, torch.float32) == int(494.7e12)
    finally:
        torch.set_float32_matmul_precision(previous)


def test_available_flops_of_an_unknown_gpu_warn_and_are_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Mystery GPU 9000")
    with pytest.warns(UserWarning, match=r"peak FLOPs of 'Mystery GPU 9000' are not known"):
        assert get_available_flops(torch.device("cuda", 0), torch.bfloat16) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.warns(UserWarning, match=r"'Tesla T4' has no peak FLOPs for torch.bfloat16"):
        assert get_available_flops(torch.device("cuda", 0), torch.bfloat16) is None

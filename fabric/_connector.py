"""Flags + environment in, one fully built Strategy out. Runs once, inside Fabric.__init__."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from fabric._cli_flags import cli_flags, merge_cli_flags, under_cli
from fabric.accelerators import ACCELERATOR_REGISTRY, Accelerator
from fabric.accelerators.cuda import check_bf16_supported
from fabric.accelerators.xla import XLAAccelerator, on_tpu_host
from fabric.environments import ClusterEnvironment, ProcessGroupEnvironment, detect_environment
from fabric.io import CheckpointIO, TorchCheckpointIO
from fabric.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from fabric.precision._names import LEGACY_PRECISION, PRECISIONS
from fabric.registry import did_you_mean
from fabric.strategies import STRATEGY_REGISTRY, SingleDeviceStrategy, Strategy
from fabric.utilities.exceptions import FabricTypeError, FabricValueError
from fabric.utilities.warnings import PossibleUserWarning


def _describe(strategy: Any) -> str:
    return f"{type(strategy).__name__}()" if isinstance(strategy, Strategy) else repr(strategy)


def _lower(flag: Any) -> Any:
    return flag.lower() if isinstance(flag, str) else flag


def _names(names: Iterable[str]) -> str:
    return ", ".join(names)


def connect(
    accelerator: str | Accelerator,
    strategy: str | Strategy,
    devices: Any,
    num_nodes: int,
    precision: Any,
    plugins: Any,
) -> tuple[Strategy, bool]:
    """Resolve every flag against the others and the environment; the strategy, and whether `fabric run` started us."""
    # Names are case-insensitive: strategy="DDP" (as in Lightning Fabric), and accelerator and precision alike.
    accelerator, strategy, precision = _lower(accelerator), _lower(strategy), _lower(precision)
    cli = cli_flags()
    if cli:
        accelerator, strategy, devices, num_nodes, precision = merge_cli_flags(
            cli, accelerator=accelerator, strategy=strategy, devices=devices, num_nodes=num_nodes, precision=precision
        )
    precision_plugin, environment, checkpoint_io = _split_plugins(plugins)
    user_strategy = strategy if isinstance(strategy, Strategy) else None
    if precision is not None and precision_plugin is not None:
        raise FabricValueError(
            f"Fabric(precision={precision!r}, plugins=[{type(precision_plugin).__name__}]): both set the precision. "
            "Pass one of them."
        )
    _check_num_nodes(num_nodes)
    environment = _resolve_environment(environment, user_strategy)
    accel = _resolve_accelerator(accelerator, user_strategy)
    indices = _resolve_devices(accel, devices, num_nodes, environment, strategy)
    _warn_if_oversubscribed(accel, indices, devices, environment)
    if user_strategy is None:
        user_strategy = _build_strategy(strategy, indices, num_nodes, accelerator, devices, accel)
    _check_xla_pairing(accel, user_strategy, accelerator, strategy)
    precision_plugin = _resolve_precision(precision, precision_plugin, user_strategy, accel)
    if isinstance(user_strategy, SingleDeviceStrategy) and len(indices) * num_nodes > 1:
        raise FabricValueError(
            f"Fabric(strategy={_describe(strategy)}, devices={devices!r}, num_nodes={num_nodes}): a single-device "
            f"strategy cannot run on {len(indices) * num_nodes} devices. Use strategy='ddp' (or 'auto'), or devices=1."
        )
    user_strategy._connect(
        accelerator=accel,
        precision=precision_plugin,
        checkpoint_io=checkpoint_io or TorchCheckpointIO(),
        cluster_environment=environment,
        parallel_devices=accel.get_parallel_devices(indices),
        num_nodes=num_nodes,
    )
    return user_strategy, under_cli()


def _split_plugins(plugins: Any) -> tuple[Precision | None, ClusterEnvironment | None, CheckpointIO | None]:
    if plugins is None:
        return None, None, None
    items = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    found: dict[type, Any] = {}
    for plugin in items:
        role = next((r for r in (Precision, ClusterEnvironment, CheckpointIO) if isinstance(plugin, r)), None)
        if role is None:
            raise FabricTypeError(
                f"Fabric(plugins=[{type(plugin).__name__}]): not a plugin fabric knows. Pass instances of "
                "Precision, ClusterEnvironment or CheckpointIO (strategies go in strategy=, hardware in accelerator=)."
            )
        if role in found:
            raise FabricValueError(
                f"Fabric(plugins=[{type(found[role]).__name__}, {type(plugin).__name__}]): two {role.__name__} "
                "plugins were passed, and only one can be used. Pass one."
            )
        found[role] = plugin
    return found.get(Precision), found.get(ClusterEnvironment), found.get(CheckpointIO)


def _check_num_nodes(num_nodes: Any) -> None:
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise FabricValueError(
            f"Fabric(num_nodes={num_nodes!r}): the number of machines must be an int >= 1. Pass e.g. 1."
        )


def _resolve_environment(plugin: ClusterEnvironment | None, strategy: Strategy | None) -> ClusterEnvironment:
    own = strategy.cluster_environment if strategy is not None else None
    if plugin is not None and own is not None and plugin is not own:
        raise FabricValueError(
            f"Fabric(strategy={type(strategy).__name__}(cluster_environment={type(own).__name__}), "
            f"plugins=[{type(plugin).__name__}]): two cluster environments were given. Pass only one."
        )
    return plugin or own or detect_environment()


def _resolve_accelerator(flag: str | Accelerator, strategy: Strategy | None) -> Accelerator:
    own = strategy.accelerator if strategy is not None else None
    if isinstance(flag, Accelerator):
        chosen: Accelerator = flag
    elif not isinstance(flag, str):
        raise FabricTypeError(f"Fabric(accelerator={flag!r}): expected a name or an Accelerator instance.")
    elif flag == "auto":
        if own is not None:
            return own
        chosen = _auto_accelerator()
    else:
        chosen = _named_accelerator(flag)
    if own is not None and type(own) is not type(chosen):
        raise FabricValueError(
            f"Fabric(accelerator={flag!r}, strategy={type(strategy).__name__}(accelerator="
            f"{type(own).__name__}())): the strategy's accelerator disagrees with accelerator=. "
            "Set the accelerator in one place only."
        )
    if not chosen.is_available():
        raise RuntimeError(
            f"Fabric(accelerator={flag!r}): {type(chosen).__name__} is not available on this machine. "
            "Use accelerator='auto' or 'cpu'."
        )
    return own or chosen


def _auto_accelerator() -> Accelerator:
    # XLA only on a TPU host: torch_xla installed for CPU tests must not turn 'auto' into XLA on the CPU.
    if on_tpu_host():
        return XLAAccelerator()
    for name in ("cuda", "mps", "cpu"):
        factory, kwargs = ACCELERATOR_REGISTRY.get(name)
        if factory.is_available():  # type: ignore[attr-defined]
            return factory(**kwargs)
    raise AssertionError("the CPU accelerator is always available")


def _named_accelerator(name: str) -> Accelerator:
    if name == "gpu":
        for candidate in ("cuda", "mps"):
            factory, kwargs = ACCELERATOR_REGISTRY.get(candidate)
            if factory.is_available():  # type: ignore[attr-defined]
                return factory(**kwargs)
        raise RuntimeError(
            "Fabric(accelerator='gpu'): no GPU (CUDA or MPS) is available on this machine. "
            "Use accelerator='cpu' or 'auto'."
        )
    if name not in ACCELERATOR_REGISTRY:
        raise FabricValueError(
            f"Fabric(accelerator={name!r}): unknown accelerator {name!r}. Choose one of: auto, gpu, "
            f"{_names(ACCELERATOR_REGISTRY.names())}, or pass an Accelerator instance."
            + did_you_mean(name, ["auto", "gpu", *ACCELERATOR_REGISTRY.names()])
        )
    factory, kwargs = ACCELERATOR_REGISTRY.get(name)
    return factory(**kwargs)


def _resolve_devices(
    accel: Accelerator, devices: Any, num_nodes: int, env: ClusterEnvironment, strategy: Any
) -> list[int]:
    """Device indices for this machine; under an external launcher they must match what it started."""
    if _names_single_device(strategy):
        # One device, whatever the environment: a single-device strategy runs alone in this process (rank 0 of 1),
        # beside any process group, as in Lightning Fabric. An explicit devices=2 is refused by connect().
        return accel.parse_devices(1 if devices == "auto" else devices)
    if not env.creates_processes_externally:
        return accel.parse_devices(devices)
    if devices != "auto" and num_nodes == 1 and _standalone_in_group(env, strategy):
        indices = accel.parse_devices(devices)
        if len(indices) == 1:
            return indices
    per_node = env.processes_per_node()
    if per_node is not None and devices == "auto":
        devices = per_node  # a count: N processes on the CPU, the first N devices elsewhere
    indices = accel.parse_devices(devices)
    env.validate_settings(len(indices), num_nodes)
    return indices


def _warn_if_oversubscribed(accel: Accelerator, indices: list[int], devices: Any, env: ClusterEnvironment) -> None:
    """More CPU processes on this machine than cores this process may use: they compete and all run slower.

    Warned by local rank 0 only (the process that starts the others, or the first one a launcher started), so a
    run warns once, not once per process.
    """
    if len(indices) < 2 or accel.get_parallel_devices([0])[0].type != "cpu" or env.local_rank() != 0:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if len(indices) <= cores:
        return
    warnings.warn(
        f"Fabric(accelerator='cpu', devices={devices!r}): {len(indices)} processes on this machine, but only "
        f"{cores} CPU core(s) are available to this process (os.sched_getaffinity), so the processes compete for "
        f"cores and the run is slower than with fewer processes. Use devices={cores} or fewer.",
        PossibleUserWarning,
        stacklevel=4,
    )


def _names_single_device(strategy: Any) -> bool:
    """strategy='single_device' or a SingleDeviceStrategy: the user asked for one process on one device."""
    return strategy == "single_device" or isinstance(strategy, SingleDeviceStrategy)


def _standalone_in_group(env: ClusterEnvironment, strategy: Any) -> bool:
    """Whether one device asked for explicitly inside a process group that is already running (libraries do this to
    merge weights after a distributed run) gives, as in Lightning Fabric, a single-device Fabric that neither joins
    nor touches the group. strategy='auto' with devices='auto' still joins it."""
    return strategy == "auto" and isinstance(env, ProcessGroupEnvironment)


def _build_strategy(
    flag: Any, indices: list[int], num_nodes: int, accelerator: Any, devices: Any, accel: Accelerator
) -> Strategy:
    if not isinstance(flag, str):
        raise FabricTypeError(
            f"Fabric(strategy={flag!r}): expected a strategy name or a Strategy instance. Pass e.g. 'ddp'."
        )
    name = flag
    if name == "auto":
        many = len(indices) * num_nodes > 1
        if isinstance(accel, XLAAccelerator):
            name = "xla" if many else "single_xla"
        else:
            name = "ddp" if many else "single_device"
    if name == "dp" and len(indices) * num_nodes > 1 and accel.get_parallel_devices([0])[0].type == "cpu":
        name = _dp_on_cpus(devices, num_nodes)
    if name not in STRATEGY_REGISTRY:
        raise FabricValueError(
            f"Fabric(strategy={flag!r}): unknown strategy {flag!r}. Choose one of: auto, "
            f"{_names(STRATEGY_REGISTRY.names())}, or pass a Strategy instance."
            + did_you_mean(flag, ["auto", *STRATEGY_REGISTRY.names()])
        )
    factory, kwargs = STRATEGY_REGISTRY.get(name)
    return factory(**kwargs)


def _dp_on_cpus(devices: Any, num_nodes: int) -> str:
    """DataParallel replicates over GPUs only; Lightning Fabric runs 'dp' on several CPU devices as 'ddp' (one
    process per device, the same training), and so does fabric, saying so."""
    warnings.warn(
        f"Fabric(strategy='dp', accelerator='cpu', devices={devices!r}, num_nodes={num_nodes}): DataParallel "
        "replicates the model over GPUs only, so fabric uses strategy='ddp' instead (one process per CPU device, "
        "as Lightning Fabric does); call fabric.launch() to start them. Pass strategy='ddp' to silence this warning.",
        stacklevel=5,
    )
    return "ddp"


def _check_xla_pairing(accel: Accelerator, strategy: Strategy, accelerator_flag: Any, strategy_flag: Any) -> None:
    """XLA devices need a strategy that drives them (torch_xla's step and loader); others would skip them silently."""
    if isinstance(accel, XLAAccelerator) and not strategy.drives_xla:
        raise FabricValueError(
            f"Fabric(accelerator={accelerator_flag!r}, strategy={_describe(strategy_flag)}): "
            f"{type(strategy).__name__} does not drive XLA devices (it would skip torch_xla's optimizer step and "
            "device loader). Use strategy='auto', 'single_xla', 'xla', 'xla_fsdp' or 'xla_spmd'."
        )


def _resolve_precision(flag: Any, plugin: Precision | None, strategy: Strategy, accel: Accelerator) -> Precision:
    own = strategy._precision
    if own is not None and (flag is not None or plugin is not None):
        raise FabricValueError(
            f"Fabric(precision={flag!r}, strategy={type(strategy).__name__}(precision={type(own).__name__})): "
            "the precision is set twice. Set it in one place only."
        )
    if own is not None or plugin is not None:
        return own or plugin  # type: ignore[return-value]
    name = flag if flag is not None else "32-true"
    if isinstance(flag, (int, str)):
        name = LEGACY_PRECISION.get(flag, flag)
    if name not in PRECISIONS:
        raise FabricValueError(
            f"Fabric(precision={flag!r}): unknown precision {flag!r}. Choose one of: {_names(PRECISIONS)} "
            "(or the legacy 32, 64, 16, 'bf16'), or pass a Precision plugin."
            + did_you_mean(str(flag), [*PRECISIONS, *(k for k in LEGACY_PRECISION if isinstance(k, str))])
        )
    return _make_precision(name, accel, strategy)


def _make_precision(name: str, accel: Accelerator, strategy: Strategy) -> Precision:
    device_type = accel.get_parallel_devices([0])[0].type
    if name == "16-mixed" and device_type == "cpu":
        # Lightning Fabric falls back the same way; float16 autocast on CPU is slow and needs a scaler.
        warnings.warn(
            "Fabric(accelerator='cpu', precision='16-mixed'): float16 mixed precision is not supported on the CPU; "
            "using 'bf16-mixed' instead. Pass precision='bf16-mixed' to silence this warning.",
            stacklevel=4,
        )
        name = "bf16-mixed"
    if name.startswith("bf16") and device_type == "cuda" and torch.cuda.is_initialized():
        # Only where CUDA is already up: initialising it here would make ddp_fork refuse to launch. Otherwise
        # the check runs in each process once it is launched (Fabric's worker setup).
        check_bf16_supported(torch.device("cuda", torch.cuda.current_device()), name)
    own = strategy._precision_plugin(name, device_type)  # DeepSpeed applies a precision its own way
    if own is not None:
        return own
    if name in ("16-mixed", "bf16-mixed"):
        return MixedPrecision(name, device=device_type)  # type: ignore[arg-type]
    if name in ("16-true", "bf16-true"):
        return HalfPrecision(name)  # type: ignore[arg-type]
    if name == "64-true":
        if device_type == "mps":
            raise FabricValueError("Fabric(accelerator='mps', precision='64-true'): MPS has no float64. Use '32-true'.")
        return DoublePrecision()
    return Precision()

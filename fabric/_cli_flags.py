"""The flags `fabric run` hands to the processes it starts, merged with the flags given in code."""

from __future__ import annotations

import os
from typing import Any

from fabric.accelerators import ACCELERATOR_REGISTRY
from fabric.precision._names import LEGACY_PRECISION
from fabric.strategies import STRATEGY_REGISTRY
from fabric.utilities.exceptions import FabricValueError

# `fabric run` hands its flags to the processes it starts through these variables (see fabric/cli.py).
CLI_ENV_PREFIX = "FABRIC_CLI_"
# A flag still at this value in Fabric(...) takes the command's value.
_CLI_DEFAULTS: dict[str, Any] = {"accelerator": "auto", "strategy": "auto", "devices": "auto", "num_nodes": 1,
                                 "precision": None}  # fmt: skip


def cli_flags() -> dict[str, str]:
    """The flags `fabric run` set for this process, by Fabric argument name (empty when not under `fabric run`)."""
    return {name: os.environ[key] for name in _CLI_DEFAULTS if (key := CLI_ENV_PREFIX + name.upper()) in os.environ}


def merge_cli_flags(cli: dict[str, str], **code: Any) -> tuple[Any, ...]:
    """Flags left at their default take the command's value; a flag set in both places must agree."""
    merged = dict(code)
    for name, text in cli.items():
        value = _cli_value(name, text)
        if _is_default(name, code[name]):
            merged[name] = value
        elif not _agrees(name, code[name], value):
            raise FabricValueError(
                f"Fabric({name}={_show(code[name])}) contradicts 'fabric run --{name.replace('_', '-')} {text}'. "
                "Set it in one place: remove it from the code or from the command."
            )
    return tuple(merged[name] for name in _CLI_DEFAULTS)


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, (str, int, float, list, tuple)) else f"{type(value).__name__}()"


def _is_default(name: str, value: Any) -> bool:
    default = _CLI_DEFAULTS[name]
    return value is None if default is None else isinstance(value, type(default)) and value == default


def _cli_value(name: str, text: str) -> Any:
    if name not in ("devices", "num_nodes"):
        return text
    try:
        return int(text)
    except ValueError:
        raise FabricValueError(
            f"{CLI_ENV_PREFIX}{name.upper()}={text!r}: `fabric run` sets this to a count, and this is not one. "
            "Start the script with `fabric run`, or unset the variable."
        ) from None


def _agrees(name: str, code: Any, cli: Any) -> bool:
    """Whether the value in code means the same as the command's (which is a name, 'auto', or a count)."""
    if cli == "auto":
        return True  # the command left the choice open
    if name == "precision":
        return LEGACY_PRECISION.get(code, code) == LEGACY_PRECISION.get(cli, cli)
    if name == "devices":
        return _device_count(code) in (None, cli)  # counts fabric cannot know here are checked by the environment
    if name in ("accelerator", "strategy") and not isinstance(code, str):
        registry = ACCELERATOR_REGISTRY if name == "accelerator" else STRATEGY_REGISTRY
        names = ("cuda", "mps") if cli == "gpu" else (cli,)
        return any(n in registry and isinstance(code, registry.get(n)[0]) for n in names)  # type: ignore[arg-type]
    if name == "accelerator" and "gpu" in (code, cli):
        return {code, cli} <= {"gpu", "cuda", "mps"}
    return bool(code == cli)


def _device_count(devices: Any) -> int | None:
    if isinstance(devices, int) and not isinstance(devices, bool):
        return devices if devices > 0 else None
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and devices.strip().strip("[]"):
        parts = [p for p in devices.strip().strip("[]").split(",") if p.strip()]
        if "," in devices or "[" in devices:
            return len(parts)
        return int(devices) if devices.strip().isdigit() and int(devices) > 0 else None
    return None

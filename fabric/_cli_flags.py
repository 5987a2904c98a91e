"""The flags `fabric run` hands to the processes it starts, merged with the flags given in code."""

from __future__ import annotations

import os
import warnings
from typing import Any

from fabric.accelerators import ACCELERATOR_REGISTRY
from fabric.precision._names import LEGACY_PRECISION
from fabric.strategies import STRATEGY_REGISTRY
from fabric.utilities.exceptions import FabricValueError

# `fabric run` hands its flags to the processes it starts through two sets of variables (see fabric/cli.py):
# Lightning's LT_* (LT_CLI_USED, LT_ACCELERATOR, ...), which Lightning's own `fabric run` sets too, and our older
# FABRIC_CLI_*, kept as aliases. Where both name a flag, LT_* wins (see _read).
CLI_ENV_PREFIX = "FABRIC_CLI_"
LIGHTNING_ENV_PREFIX = "LT_"
LIGHTNING_CLI_USED = "LT_CLI_USED"
# A flag still at this value in Fabric(...) takes the command's value.
_CLI_DEFAULTS: dict[str, Any] = {"accelerator": "auto", "strategy": "auto", "devices": "auto", "num_nodes": 1,
                                 "precision": None}  # fmt: skip


def cli_flags() -> dict[str, str]:
    """The flags `fabric run` set for this process, by Fabric argument name (empty when not under `fabric run`)."""
    flags = {name: text for name in _CLI_DEFAULTS if (text := _read(name)) is not None}
    return {name: text.lower() if name in ("accelerator", "strategy", "precision") else text
            for name, text in flags.items()}  # fmt: skip


def under_cli() -> bool:
    """Whether `fabric run` (ours, or Lightning's, which sets only LT_*) started this process."""
    used = os.environ.get(LIGHTNING_CLI_USED, "0").strip()
    lightning = used.lstrip("-").isdigit() and int(used) != 0
    return lightning or any(CLI_ENV_PREFIX + name.upper() in os.environ for name in _CLI_DEFAULTS)


def _read(name: str) -> str | None:
    lightning = os.environ.get(LIGHTNING_ENV_PREFIX + name.upper())
    ours = os.environ.get(CLI_ENV_PREFIX + name.upper())
    if lightning is not None and ours is not None and lightning != ours:
        warnings.warn(
            f"{LIGHTNING_ENV_PREFIX}{name.upper()}={lightning!r} and {CLI_ENV_PREFIX}{name.upper()}={ours!r} "
            f"disagree; using {lightning!r} (the LT_* variable wins). Unset the stale one.",
            stacklevel=5,  # the user's Fabric(...) line
        )
    return lightning if lightning is not None else ours


def _variable(name: str) -> str:
    """The variable that supplied `name`, for messages."""
    lightning = LIGHTNING_ENV_PREFIX + name.upper()
    return lightning if lightning in os.environ else CLI_ENV_PREFIX + name.upper()


def merge_cli_flags(cli: dict[str, str], **code: Any) -> tuple[Any, ...]:
    """Lightning's rules: under `fabric run`, a flag left at its default takes the command's value and one set in
    both places must agree; a variable set without `fabric run` (no LT_CLI_USED) replaces the code's value."""
    merged = dict(code)
    strict = under_cli()
    for name, text in cli.items():
        value = _cli_value(name, text)
        if _is_default(name, code[name]) or not strict:
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
    if name == "devices":
        # A count ("2", "-1") or what Lightning's CLI passes through as typed: "auto", a list such as "0,1".
        return int(text) if text.strip().lstrip("-").isdigit() else text
    if name != "num_nodes":
        return text
    try:
        return int(text)
    except ValueError:
        raise FabricValueError(
            f"{_variable(name)}={text!r}: `fabric run` sets this to a count, and this is not one. "
            "Start the script with `fabric run`, or unset the variable."
        ) from None


def _agrees(name: str, code: Any, cli: Any) -> bool:
    """Whether the value in code means the same as the command's (which is a name, 'auto', or a count)."""
    if cli == "auto":
        return True  # the command left the choice open
    if name == "precision":
        return LEGACY_PRECISION.get(code, code) == LEGACY_PRECISION.get(cli, cli)
    if name == "devices":
        # Counts fabric cannot know here ("auto", -1) are checked by the environment.
        return None in (_device_count(code), _device_count(cli)) or _device_count(code) == _device_count(cli)
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

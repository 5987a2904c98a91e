"""Parsing of the `devices` flag shared by all accelerators."""

from __future__ import annotations

from typing import Any

from fabric.utilities.exceptions import FabricValueError


def _bad(devices: Any, why: str, fix: str) -> FabricValueError:
    return FabricValueError(f"Fabric(devices={devices!r}): {why}. {fix}")


def parse_device_indices(devices: Any, available: int, kind: str) -> list[int]:
    """Resolve int / list / "0,1" / "2" / -1 / "auto" against `available` devices of `kind`."""
    if devices == "auto" or devices == -1 or devices == "-1":
        if available < 1:
            raise _bad(devices, f"no {kind} device is available", "Choose another accelerator.")
        return list(range(available))
    if isinstance(devices, bool):
        raise _bad(devices, "a bool is not a device count", "Pass an int such as 2, a list such as [0, 1] or 'auto'.")
    passed = devices
    if isinstance(devices, str):
        devices = _parse_str(devices)
    indices = _to_indices(devices, passed)
    if max(indices) >= available:
        raise _bad(
            passed,
            f"asks for {kind} device(s) {indices} but only {available} {kind} device(s) exist here",
            f"Ask for at most {available}, or use devices='auto'.",
        )
    return indices


def _to_indices(devices: Any, passed: Any) -> list[int]:
    """An int count or an explicit list, validated; errors quote what the user passed."""
    if isinstance(devices, int):
        if devices == 0:
            raise _bad(passed, "zero devices cannot run anything", "Pass 1 or more, or 'auto'.")
        if devices < 0:
            raise _bad(
                passed,
                "a negative count other than -1 has no meaning",
                "Pass -1 for all devices or a positive count.",
            )
        indices = list(range(devices))
    elif isinstance(devices, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in devices):
        indices = list(devices)
        if not indices:
            raise _bad(passed, "an empty list selects no device", "List at least one device index.")
        if len(set(indices)) != len(indices):
            raise _bad(passed, "a device index is listed twice", "List each device once.")
        if min(indices) < 0:
            raise _bad(passed, "device indices cannot be negative", "Use indices from 0 up.")
    else:
        raise _bad(passed, "expected an int, a list of ints, a string like '0,1', or 'auto'", "Fix the type.")
    return indices


def _parse_str(text: str) -> int | list[int]:
    parts = [p.strip() for p in text.strip().strip("[]").split(",") if p.strip()]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise _bad(text, "not a number or a comma-separated list of numbers", "Pass e.g. 2, '0,1' or 'auto'.") from None
    # "2" means two devices; "1," or "0,1" means those indices, as Lightning users expect.
    if len(values) == 1 and "," not in text:
        return values[0]
    return values

"""torch.load with safe defaults: no code from pickles unless asked, clear errors, tensors back on their devices."""

from __future__ import annotations

import pickle
import re
from collections import OrderedDict
from typing import IO, Any

import torch
from torch import _weights_only_unpickler

from fabric.utilities.exceptions import FabricTypeError

_REFUSED = re.compile(r"GLOBAL ([\w.]+)")
_UNSUPPORTED = re.compile(r"Unsupported operand (\d+)")
# What torch.load raises for bytes that are no checkpoint at all (garbage, truncation, text, an empty file).
_UNREADABLE_RUNTIME = ("PytorchStreamReader", "zip archive", "Invalid magic number", "corrupt")


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint needs arbitrary unpickling (which can run code), and the caller did not allow it."""


def refused(path: str, op: str, names: list[str]) -> UnsafeCheckpointError:
    """The error for a checkpoint that was not unpickled because it could run code."""
    what = ", ".join(names) if names else "objects that are not tensors or plain Python values"
    return UnsafeCheckpointError(
        f"{op}({path!r}): refused to load the checkpoint for safety: unpickling it would import {what}, and "
        "unpickling arbitrary objects can run any code. If you trust this file (you or a trusted source wrote it), "
        f"load it with {op}(..., weights_only=False); or allow those classes with "
        "torch.serialization.add_safe_globals([...]) and keep the safe default."
    )


def unreadable(path: str, op: str, err: BaseException) -> RuntimeError:
    """The error for bytes that are not a checkpoint torch.load can read."""
    detail = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no detail'}"
    return RuntimeError(
        f"{op}({path!r}): this is not a readable checkpoint ({detail[:200]}): the file is truncated, corrupt or was "
        "not written by torch.save/fabric.save. Load an intact checkpoint (an interrupted copy or download is the "
        "usual cause)."
    )


def check_weights_only(weights_only: Any, op: str) -> None:
    """`weights_only` decides whether a file may run code: only True, False or None (the safe default) mean it."""
    if weights_only is not None and not isinstance(weights_only, bool):
        raise FabricTypeError(
            f"{op}(..., weights_only={weights_only!r}): weights_only must be True, False or None, not "
            f"{type(weights_only).__name__}: it decides whether loading may run code from the file. Leave it out "
            "(or pass True) for the safe default; pass False only for a file you trust."
        )


def torch_load(
    source: str | IO[bytes],
    path: str,
    op: str,
    map_location: Any,
    weights_only: bool | None,
    mmap: bool = False,
) -> Any:
    """torch.load that refuses arbitrary unpickling unless `weights_only` is False, and names `path` on failure."""
    check_weights_only(weights_only, op)
    safe = weights_only is None or weights_only
    try:
        return torch.load(source, map_location=map_location, weights_only=safe, mmap=mmap or None)
    except pickle.UnpicklingError as err:
        message = str(err)
        if safe and "Weights only load failed" in message and "GLOBAL" in message:
            raise refused(path, op, _unsafe_globals(source) or _REFUSED.findall(message)) from None
        if safe and (code := _UNSUPPORTED.search(message)):
            raise unsupported(source, path, op, int(code.group(1))) from None
        raise unreadable(path, op, _first_cause(err)) from None
    except (EOFError, KeyError, IndexError, ValueError, AssertionError, UnicodeDecodeError) as err:
        # What torch's (weights-only) unpickler raises on bytes that are no pickle at all.
        raise unreadable(path, op, err) from None
    except RuntimeError as err:
        if any(marker in str(err) for marker in _UNREADABLE_RUNTIME):
            raise unreadable(path, op, err) from None
        raise


def unsupported(
    source: str | IO[bytes], path: str, op: str, code: int, also_allowed: frozenset[str] = frozenset()
) -> BaseException:
    """The error for a pickle that torch's weights-only unpickler stopped at opcode `code` (it runs nothing).

    A well-formed pickle is not called corrupt: if it names globals beyond torch's allowed ones, it is refused as
    unsafe (naming them); otherwise it is a valid checkpoint that only the unrestricted loader can read.
    """
    from fabric.io import _pickle_scan  # pickletools is slow to import; only failed loads need it

    found = _pickle_scan.scan(source)
    if found is None:
        return unreadable(path, op, pickle.UnpicklingError(f"unsupported opcode {_pickle_scan.opcode_name(code)}"))
    allowed = also_allowed | set(_weights_only_unpickler._get_allowed_globals())
    allowed |= set(_weights_only_unpickler._get_user_allowed_globals())
    unsafe = sorted({name for name in found.globals if name not in allowed})
    if unsafe:
        return refused(path, op, unsafe)
    opcode = _pickle_scan.opcode_name(code)
    why = (
        f"it was written with pickle protocol {found.protocol}, and that loader does not support its opcode {opcode} "
        "(torch.save writes protocol 2 unless pickle_protocol is given)"
        if found.protocol > 2
        else f"it uses the pickle opcode {opcode}, which that loader does not support"
    )
    return UnsafeCheckpointError(
        f"{op}({path!r}): the checkpoint is intact, but torch's weights-only loader (the safe default) cannot read "
        f"it: {why}. If you trust this file (you or a trusted source wrote it), load it with {op}(..., "
        "weights_only=False); or save it again with torch.save's default pickle_protocol."
    )


def _unsafe_globals(source: str | IO[bytes]) -> list[str]:
    """Every global the checkpoint would import that weights_only forbids (found statically, nothing runs)."""
    try:
        if not isinstance(source, str):
            source.seek(0)
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(source))
    except Exception:  # a legacy (non-zip) file: torch's own message names the first one
        return []


def _first_cause(err: pickle.UnpicklingError) -> BaseException:
    # torch's weights-only message is a page long; the line that matters is the unpickler's own complaint.
    lines = [line for line in str(err).splitlines() if line.strip()]
    detail = next((line for line in lines if "Unsupported" in line or "Memo" in line), lines[-1] if lines else "")
    return pickle.UnpicklingError(detail.strip())


def saved_device_or_cpu(storage: Any, location: str) -> Any:
    """A map_location: torch's own placement (the saved device), falling back to CPU where that device is absent."""
    try:
        return torch.serialization.default_restore_location(storage, location)
    except RuntimeError:
        return storage


class DeviceRecorder:
    """A torch.load map_location that keeps every tensor on CPU and remembers the device it was saved from.

    Loading everything to CPU first keeps GPU memory free for the modules and optimizers (their load_state_dict
    copies into their own device); afterwards `restore` moves only the plain tensors back to their device.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self._device = device
        self._saved: dict[int, str] = {}

    def __call__(self, storage: Any, location: str) -> Any:
        if location != "cpu":
            self._saved[storage.data_ptr()] = location
        return storage

    def target(self, tensor: torch.Tensor) -> torch.device | None:
        """Where `tensor` belongs: this process's device of the saved kind, else the saved device if it exists."""
        if tensor.device.type != "cpu" or tensor.untyped_storage().nbytes() == 0:
            return None
        location = self._saved.get(tensor.untyped_storage().data_ptr())
        if location is None:
            return None
        saved = torch.device(location)
        if self._device is not None and self._device.type == saved.type:
            return self._device
        if not _exists(saved):
            return None
        # Several processes read one file saved by rank 0: each takes its own current device of that kind.
        current = getattr(getattr(torch, saved.type, None), "current_device", None)
        return torch.device(saved.type, current()) if saved.index is not None and callable(current) else saved

    def restore(self, value: Any) -> Any:
        """`value` with every tensor in it (through dicts, lists and tuples) moved back to its device."""
        if isinstance(value, torch.Tensor):
            device = self.target(value)
            return value if device is None else value.to(device)
        if isinstance(value, dict):
            return type(value)((k, self.restore(v)) for k, v in value.items()) if _plain(value) else value
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            return type(value)(self.restore(v) for v in value)
        return value


def _plain(value: dict[Any, Any]) -> bool:
    return type(value) in (dict, OrderedDict)


def _exists(device: torch.device) -> bool:
    if device.type in ("cpu", "meta"):
        return True
    module = getattr(torch, device.type, None)
    try:
        available = bool(module.is_available()) if module is not None else False
        return available and (device.index is None or device.index < module.device_count())  # type: ignore[union-attr]
    except (AttributeError, RuntimeError):
        return False

"""Hostile pickles, written opcode by opcode: each names a global that a careless loader would import or call.

Nothing here is unpickled by this module; the tests hand the bytes to fabric's loaders, which must refuse them
before importing anything.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# Modules written into a temporary folder on sys.path: importing them is the attack.
WRITER_MODULE = "fabric_hostile_writer"
EXIT_MODULE = "fabric_hostile_exit"


def write_side_effect_modules(folder: Path, marker: Path) -> None:
    """One module that writes `marker` when imported, one that ends the process (SystemExit(0)) when imported."""
    (folder / f"{WRITER_MODULE}.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\ndef run(*a): pass\n")
    (folder / f"{EXIT_MODULE}.py").write_text("raise SystemExit(0)\n")


def _line(text: str) -> bytes:
    return text.encode() + b"\n"


def _short_str(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def _str2(text: str) -> bytes:
    data = text.encode()
    return b"X" + len(data).to_bytes(4, "little") + data  # BINUNICODE (protocol 1+)


PROTO2 = b"\x80\x02"
PROTO4 = b"\x80\x04"
STOP = b"."


def global_op(module: str, name: str) -> bytes:
    """GLOBAL: push module.name (the unpickler imports `module` to find it)."""
    return b"c" + _line(module) + _line(name)


def stack_global(module: str, name: str) -> bytes:
    """STACK_GLOBAL (protocol 4): the same, with both names taken from the stack."""
    return _short_str(module) + _short_str(name) + b"\x93"


@dataclass(frozen=True)
class Hostile:
    """A named hostile pickle: `build(module, name, argument)` returns its bytes."""

    kind: str
    build: Callable[[str, str, str], bytes]


def _reduce(module: str, name: str, arg: str) -> bytes:
    # GLOBAL f, (arg,), REDUCE: f(arg)
    return PROTO2 + global_op(module, name) + _str2(arg) + b"\x85" + b"R" + STOP


def _stack_reduce(module: str, name: str, arg: str) -> bytes:
    return PROTO4 + stack_global(module, name) + _short_str(arg) + b"\x85" + b"R" + STOP


def _global_only(module: str, name: str, arg: str) -> bytes:
    return PROTO2 + global_op(module, name) + STOP


def _build(module: str, name: str, arg: str) -> bytes:
    # GLOBAL cls, (), NEWOBJ, {"x": arg}, BUILD: cls.__new__(cls) then __setstate__ / __dict__.update
    state = b"}" + _str2("x") + _str2(arg) + b"s"
    return PROTO2 + global_op(module, name) + b")" + b"\x81" + state + b"b" + STOP


def _inst(module: str, name: str, arg: str) -> bytes:
    # MARK, arg, INST module name: module.name(arg)
    return b"(" + b"V" + _line(arg) + b"i" + _line(module) + _line(name) + STOP


def _obj(module: str, name: str, arg: str) -> bytes:
    # MARK, GLOBAL cls, arg, OBJ: cls(arg)
    return PROTO2 + b"(" + global_op(module, name) + _str2(arg) + b"o" + STOP


def _nested(module: str, name: str, arg: str) -> bytes:
    # {"state": [{"deep": f(arg)}]}: the call sits inside ordinary containers
    call = global_op(module, name) + _str2(arg) + b"\x85" + b"R"
    inner = b"}" + _str2("deep") + call + b"s"
    return PROTO2 + b"}" + _str2("state") + b"]" + inner + b"a" + b"s" + STOP


CORPUS = [
    Hostile("GLOBAL", _global_only),
    Hostile("GLOBAL+REDUCE", _reduce),
    Hostile("STACK_GLOBAL+REDUCE", _stack_reduce),
    Hostile("BUILD", _build),
    Hostile("INST", _inst),
    Hostile("OBJ", _obj),
    Hostile("nested", _nested),
]


def torch_file(data_pkl: bytes) -> bytes:
    """A torch.save zip archive whose object pickle (`data.pkl`) is `data_pkl`."""
    buffer = io.BytesIO()
    torch.save({}, buffer)
    buffer.seek(0)
    out = io.BytesIO()
    with zipfile.ZipFile(buffer) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            data = data_pkl if info.filename.endswith("/data.pkl") else source.read(info)
            target.writestr(info, data)
    return out.getvalue()

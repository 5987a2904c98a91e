"""Reading a checkpoint's pickle without running it: is it intact, which protocol, which globals would it import.

Used only to explain why torch's weights-only loader refused a file: a well-formed pickle it cannot read (a newer
protocol, an opcode it does not support) is not a corrupt file, and the globals it names say what trusting it means.
"""

from __future__ import annotations

import io
import pickletools
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

# Legacy (non-zip) torch.save files are five pickles (magic number, protocol, system info, data, storage keys)
# followed by raw storage bytes; a plain pickle file is one.
_MAX_PICKLES = 5
_STRINGS = frozenset(
    {"UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "STRING", "BINSTRING", "SHORT_BINSTRING"}
)
_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_OPCODE_NAMES = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}


@dataclass
class Scan:
    """What a static read of the pickle found."""

    protocol: int = 2
    globals: list[str] = field(default_factory=list)


def opcode_name(code: int) -> str:
    """The pickle opcode with this byte value, by name (``149`` -> ``FRAME``)."""
    return _OPCODE_NAMES.get(code, f"byte {code}")


def scan(source: str | IO[bytes]) -> Scan | None:
    """The protocol and globals of a torch.save file or a plain pickle; None if it is not a well-formed pickle."""
    try:
        data = _main_pickle(source)
        if data is not None:
            return _scan_stream(io.BytesIO(data), pickles=1)
        stream = Path(source).open("rb") if isinstance(source, str) else source  # noqa: SIM115 (closed below)
        try:
            stream.seek(0)
            return _scan_stream(stream, pickles=_MAX_PICKLES)
        finally:
            if isinstance(source, str):
                stream.close()
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError, UnicodeDecodeError):
        return None


def _main_pickle(source: str | IO[bytes]) -> bytes | None:
    """The `data.pkl` record of a zip checkpoint (checked against its CRC); None for a non-zip file."""
    if not isinstance(source, str):
        source.seek(0)
    if not zipfile.is_zipfile(source):
        return None
    if not isinstance(source, str):
        source.seek(0)
    with zipfile.ZipFile(source) as archive:
        names = [n for n in archive.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
        if not names:
            raise KeyError("no data.pkl record")
        return archive.read(names[0])


def _scan_stream(stream: IO[bytes], pickles: int) -> Scan:
    result = Scan()
    for index in range(pickles):
        if index and not stream.read(1):
            break  # the end of the file after a complete pickle
        if index:
            stream.seek(-1, io.SEEK_CUR)
        _scan_one(stream, result)
    return result


def _scan_one(stream: IO[bytes], result: Scan) -> None:
    """Walk one pickle's opcodes (pickletools parses them, nothing is imported or called)."""
    memo: dict[Any, Any] = {}
    strings: list[str] = []  # the strings pushed so far: STACK_GLOBAL takes its names from the last two
    top: Any = None  # what the previous opcode pushed, for MEMOIZE and PUT
    for opcode, arg, _ in pickletools.genops(stream):
        name = opcode.name
        if name == "PROTO":
            result.protocol = max(result.protocol, int(arg or 0))
        elif name in ("GLOBAL", "INST"):
            result.globals.append(str(arg).replace(" ", ".", 1))
        elif name == "STACK_GLOBAL":
            result.globals.append(".".join(strings[-2:]) if len(strings) >= 2 else "(a name built on the stack)")
        if name == "MEMOIZE":
            memo[len(memo)] = top
            continue
        if name in _PUTS:
            memo[arg] = top
            continue
        top = arg if name in _STRINGS else memo.get(arg) if name in _GETS else None
        if isinstance(top, bytes):
            top = top.decode("latin-1")
        if isinstance(top, str):
            strings.append(top)

"""The user's line that issued a collective: the first stack frame outside the fabric package.

The hot path keeps only that frame's code object and instruction offset (two attribute reads); the `file.py:LINE`
text is made from them when a message or a publication needs it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path
from types import CodeType, FrameType

# fabric/, from fabric/diagnostics/, as the code objects name it (unresolved) and resolved (a symlinked install).
_FABRIC_DIRS = {str(Path(__file__).parent.parent) + os.sep, str(Path(__file__).resolve().parent.parent) + os.sep}
# contextlib's frames sit between fabric's frames when a collective is issued from a `with` block in fabric.
_SKIPPED = (*_FABRIC_DIRS, str(Path(contextlib.__file__)))


class _SkipFiles(dict[str, bool]):
    """co_filename -> whether frames of that file are skipped; one entry per source file, so it stays small.

    A hit is dict's own lookup (no Python call): `caller_outside_fabric` runs on every recorded collective.
    """

    def __missing__(self, filename: str) -> bool:
        skip = self[filename] = filename.startswith(_SKIPPED)
        return skip


_SKIP_FILE = _SkipFiles()


def caller_outside_fabric(depth: int) -> FrameType | None:
    """The first frame outside fabric, `depth` or more frames above the caller (0: the caller itself).

    Probes with `sys._getframe(n)`, which makes a frame object for the frame it returns only; stepping up through
    `f_back` makes one for every frame passed. The recorded collectives run this every step: in paired runs, a copy
    of DDPStrategy.backward whose walk passed one frame more cost 0.3-0.8% of a 2-rank tiny DDP step.
    """
    depth += 1  # this function's own frame
    try:
        frame = sys._getframe(depth)
        while _SKIP_FILE[frame.f_code.co_filename]:
            depth += 1
            frame = sys._getframe(depth)
    except ValueError:  # the whole stack is fabric's
        return None
    return frame


def site_text(code: CodeType | None, offset: int) -> str:
    """`file.py:LINE` of the instruction at byte `offset` of `code` (the base name: full paths are unreadable)."""
    if code is None:
        return "<inside fabric>"
    line = next((line for start, end, line in code.co_lines() if start <= offset < end and line), None)
    return f"{code.co_filename.rpartition(os.sep)[2]}:{line or code.co_firstlineno}"


def call_site() -> str:
    """`file.py:LINE` of the first caller outside fabric."""
    frame = caller_outside_fabric(1)
    return site_text(frame.f_code, frame.f_lasti) if frame is not None else site_text(None, -1)


def backward_caller() -> FrameType | None:
    """The user's frame that called fabric's `backward` and is still inside it, in whichever thread; else None.

    For the job-health thread, which samples this a few times a second instead of the training thread recording
    each backward (a backward is counted on the hot path, nothing more): the stacks are walked here, off that path.
    """
    current = threading.get_ident()
    for ident, frame in sys._current_frames().items():
        if ident != current:
            inside = _above_fabric_backward(frame)
            if inside is not None:
                return inside
    return None


def _above_fabric_backward(frame: FrameType | None) -> FrameType | None:
    """The first frame outside fabric above the innermost fabric function named `backward` in `frame`'s stack."""
    while frame is not None and not (frame.f_code.co_name == "backward" and _SKIP_FILE[frame.f_code.co_filename]):
        frame = frame.f_back
    while frame is not None and _SKIP_FILE[frame.f_code.co_filename]:
        frame = frame.f_back
    return frame

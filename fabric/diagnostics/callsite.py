"""The user's line that issued a collective: the first stack frame outside the fabric package."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

# fabric/, from fabric/diagnostics/, as the code objects name it (unresolved) and resolved (a symlinked install).
_FABRIC_DIRS = {str(Path(__file__).parent.parent) + os.sep, str(Path(__file__).resolve().parent.parent) + os.sep}
# contextlib's frames sit between fabric's frames when a collective is issued from a `with` block in fabric.
_SKIPPED = (*_FABRIC_DIRS, str(Path(contextlib.__file__)))


def call_site() -> str:
    """`file.py:LINE` of the first caller outside fabric (the base name: full paths make messages unreadable)."""
    frame = sys._getframe(1)  # the public alternative, inspect.stack(), costs milliseconds
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "<inside fabric>"
    # Not Path(...).name: this runs on every collective, and a Path costs microseconds.
    return f"{frame.f_code.co_filename.rpartition(os.sep)[2]}:{frame.f_lineno}"

"""One place for the shape of user-facing error messages: what was passed, why it fails, what to do."""

from __future__ import annotations


def _msg(passed: str, why: str, fix: str) -> str:
    return f"{passed}: {why}. {fix}"

"""Warning categories users filter by name, and the switch that silences the "possible user error" ones."""

from __future__ import annotations

import warnings


class PossibleUserWarning(UserWarning):
    """A warning about something that may be intended (and then is a false alarm)."""


def disable_possible_user_warnings(module: str = "") -> None:
    """Ignore ``PossibleUserWarning``s, from every module or only from ``module`` (a regular expression)."""
    warnings.filterwarnings("ignore", category=PossibleUserWarning, module=module)


__all__ = ["PossibleUserWarning", "disable_possible_user_warnings"]

"""The exception every user-facing configuration or input error of fabric derives from.

Lightning Fabric code catches `MisconfigurationException`; our errors keep the builtin type
(`ValueError`, `TypeError`) that says what went wrong, and also derive from it, so both
`except ValueError` and `except MisconfigurationException` catch them.
"""


class MisconfigurationException(Exception):
    """Flags, plugins or arguments given to fabric that cannot work together."""


class FabricValueError(MisconfigurationException, ValueError):
    """A value the user passed cannot work (wrong name, out of range, contradicts another flag)."""


class FabricTypeError(MisconfigurationException, TypeError):
    """An object of the wrong kind was passed (a string where a module is needed, ...)."""


__all__ = ["FabricTypeError", "FabricValueError", "MisconfigurationException"]

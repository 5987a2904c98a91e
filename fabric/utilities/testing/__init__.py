"""Lightning Fabric's import path ``utilities.testing``: the skip conditions client test suites build on."""

from fabric.utilities.testing._runif import _runif_reasons

__all__ = ["_runif_reasons"]

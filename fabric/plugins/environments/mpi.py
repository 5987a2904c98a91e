"""Lightning Fabric's import path ``plugins.environments.mpi`` (a re-export)."""

from fabric.environments.mpi import MPIEnvironment

__all__ = ["MPIEnvironment"]

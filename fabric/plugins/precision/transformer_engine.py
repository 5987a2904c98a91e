"""Lightning Fabric's import path ``plugins.precision.transformer_engine`` (a re-export)."""

from fabric.precision.transformer_engine import TransformerEnginePrecision

__all__ = ["TransformerEnginePrecision"]

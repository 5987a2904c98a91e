"""Lightning Fabric's import path ``utilities.logger``: hyperparameter helpers that client loggers import."""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Mapping, MutableMapping
from dataclasses import asdict, is_dataclass
from typing import Any


def _convert_params(params: Mapping[str, Any] | Namespace | None) -> dict[str, Any]:
    """Hyperparameters as a plain dict: a Namespace becomes its vars, None an empty dict."""
    if params is None:
        return {}
    if isinstance(params, Namespace):
        return dict(vars(params))
    return dict(params)


def _flatten_dict(params: MutableMapping[Any, Any], delimiter: str = "/", parent_key: str = "") -> dict[str, Any]:
    """Nested mappings, Namespaces and dataclass instances flattened to one level: {'a': {'b': 1}} -> {'a/b': 1}."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{parent_key}{delimiter}{key}" if parent_key else str(key)
        if is_dataclass(value) and not isinstance(value, type):
            value = asdict(value)
        elif isinstance(value, Namespace):
            value = vars(value)
        if isinstance(value, MutableMapping):
            flat.update(_flatten_dict(value, delimiter, name))
        elif isinstance(value, list) and all(isinstance(item, MutableMapping) for item in value):
            # a list of dicts is indexed with "/" whatever the delimiter, as in Lightning (an empty list vanishes)
            for index, item in enumerate(value):
                flat.update(_flatten_dict(item, delimiter, f"{name}/{index}"))
        else:
            flat[name] = value
    return flat


__all__ = ["_convert_params", "_flatten_dict"]

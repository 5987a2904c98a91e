"""xla_spmd checkpoints: torch_xla's DCP planners, fed with torch's own key layout so that any torch reads them.

torch_xla's SPMD planners write (and fill) each device's shard of a sharded XLA tensor, but name nested entries
their own way (a whole optimizer `param_groups` list as one value). Flattening the state the way torch's default
planner does first gives a directory that eager torch, fabric's CPU strategies and `fabric consolidate` read like
any other sharded checkpoint, without torch_xla.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import torch

from fabric.utilities.apply_func import apply_to_collection


def save_planner() -> Any:
    """A torch_xla SPMDSavePlanner that keys entries like torch's DefaultSavePlanner."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

    class _SavePlanner(SPMDSavePlanner):
        def set_up_planner(self, state_dict: Any, *args: Any, **kwargs: Any) -> None:
            # torch's DCP passes (state_dict, storage_meta, is_coordinator); torch_xla's planner takes no storage_meta.
            is_coordinator = bool(kwargs.get("is_coordinator", args[-1] if args else False))
            flat, mappings = flatten_state_dict(state_dict)
            super().set_up_planner(flat, is_coordinator)
            # The metadata's planner_data says which nested entry each flat key came from, as torch records it.
            self.mappings = mappings

        def create_local_plan(self) -> Any:
            # A tensor split along some mesh axes and copied along others has several copies of each shard.
            # torch_xla 2.9 plans a write for every copy, and DCP then records none of the tensor (seen with a
            # (fsdp, model) mesh): write each distinct shard once, from its first copy.
            plan = super().create_local_plan()
            copies = _replica_ids(self.sharded_state_dict)
            items = [
                item
                for item in plan.items
                if item.index.fqn not in copies or copies[item.index.fqn][item.index.index or 0] == 0
            ]
            return dataclasses.replace(plan, items=items)

    return _SavePlanner()


def _replica_ids(sharded: dict[str, Any]) -> dict[str, list[int]]:
    """For each sharded XLA tensor, the replica id of each of its local shards, in torch_xla's shard order."""
    import torch_xla

    names = [name for name, value in sharded.items() if hasattr(value, "global_tensor")]
    if not names:
        return {}
    found = torch_xla._XLAC._get_local_shard_replica_and_indices([sharded[name].global_tensor for name in names])
    return {name: [replica for replica, _ in shards] for name, shards in zip(names, found, strict=True)}


def load_planner(allow_partial_load: bool) -> Any:
    """A torch_xla SPMDLoadPlanner for a nested state, reading keys written by torch (or `save_planner`)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint._traverse import set_element
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

    class _LoadPlanner(SPMDLoadPlanner):
        def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
            flat, self._nested_mappings = flatten_state_dict(state_dict)
            if allow_partial_load:
                # strict=False: entries the checkpoint lacks keep their values (the caller checked the rest).
                flat = {key: value for key, value in flat.items() if key in metadata.state_dict_metadata}
            self._nested = state_dict
            super().set_up_planner(flat, metadata, is_coordinator)

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            # Non-tensor values are replaced, not filled in place: put them into the nested state itself.
            loaded = torch.load(value, weights_only=True)
            set_element(self._nested, self._nested_mappings[read_item.dest_index.fqn], loaded)

    return _LoadPlanner()


def to_cpu(state: Any) -> Any:
    """Every tensor in `state` as a CPU tensor (a whole one: XLA gathers a sharded tensor's shards)."""
    return apply_to_collection(state, torch.Tensor, lambda tensor: tensor.cpu())

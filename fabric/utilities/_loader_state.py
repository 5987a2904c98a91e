"""Position of a set-up DataLoader in its epochs: capture, checks and restore, for exact mid-epoch resume.

torchdata's StatefulDataLoader keeps the position inside an epoch (sampler, workers, their seeds); this module
adds what it does not know: the epoch number the sampler was told, what the loader reads (to refuse a state from
another loader), and each rank's own state in a checkpoint that one rank writes.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from fabric.utilities.exceptions import FabricTypeError, FabricValueError

if TYPE_CHECKING:
    from fabric._dataloader import _FabricDataLoader

# The marker and version of a loader state saved by fabric; a checkpoint entry without it is not one.
MARKER = "fabric_loader_state"
VERSION = 1
# torchdata is a dependency of torchfabric; this is for an environment that lacks it anyway.
INSTALL = "pip install torchdata (a dependency of torchfabric: pip install torchfabric installs it)"
# Samplers that draw a new order from the global RNG (or their generator) when an epoch starts.
_RANDOM_PER_ITER = (RandomSampler, WeightedRandomSampler, SubsetRandomSampler)


def stateful_loader_class() -> type[DataLoader] | None:
    """torchdata's StatefulDataLoader, or None when torchdata is not installed."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return None
    return StatefulDataLoader


def make_stateful(loader: DataLoader) -> DataLoader:
    """The same loader rebuilt as a StatefulDataLoader, whose position can be saved and restored.

    Only a plain ``DataLoader`` is rebuilt: a subclass keeps its class (the user's code may rely on it), and a
    StatefulDataLoader already is one. Without torchdata the loader is returned as is; saving it then says how
    to install torchdata. A sampler that draws its order when an epoch starts (``RandomSampler``,
    ``WeightedRandomSampler``, ``SubsetRandomSampler``) is wrapped so that the order stays exactly PyTorch's and
    a resumed epoch can draw it again (see fabric/utilities/_replay_sampler.py).
    """
    stateful = stateful_loader_class()
    if stateful is None or type(loader) is not DataLoader:
        return loader
    from fabric.utilities._replay_sampler import _ReplaySampler
    from fabric.utilities.data import _DATALOADER_PARAMS, _RebuildContext, _sampling_values

    ctx = _RebuildContext("setup_dataloaders", "as a StatefulDataLoader", "pass a DataLoader without it")
    values: dict[str, Any] = {name: getattr(loader, name) for name in _DATALOADER_PARAMS if hasattr(loader, name)}
    values.update(_sampling_values(loader, None, ctx))
    values["shuffle"] = False
    if type(values["sampler"]) in _RANDOM_PER_ITER:
        values["sampler"] = _ReplaySampler(values["sampler"])
    with warnings.catch_warnings():
        # torchdata 0.11 calls torch.set_vital, which torch now deprecates; nothing the user can act on.
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        return _on_demand_class(stateful)(**values)


def _on_demand_class(stateful: type[DataLoader]) -> type[DataLoader]:
    """fabric's StatefulDataLoader that computes its position on a save (see _stateful_loader.py), else `stateful`."""
    try:
        from fabric.utilities._stateful_loader import _FabricStatefulDataLoader
    except ImportError:  # it reads torchdata 0.11's state format: a torchdata that moved those names keeps its own
        return stateful
    return _FabricStatefulDataLoader


def inner_state(loader: DataLoader, batches: int, unused: bool) -> dict[str, Any]:
    """The stateful loader's own state after `batches` batches of its current epoch.

    fabric's loader computes it now (see _stateful_loader.py); any other StatefulDataLoader reports the batches
    it gave out, which is one more than `batches` when the loop has not used the last one (`unused`).
    """
    position = getattr(loader, "position_state", None)
    state = position(batches) if position is not None else None
    if state is not None:
        return state
    if unused:
        warnings.warn(
            f"fabric.save(state with a loader): the loop holds a batch that no optimizer step has used yet (the "
            f"save came before optimizer.step()), and this {type(loader).__name__} (an IterableDataset, or a "
            "dataset or sampler with a state of its own) can only save a position after it, so a resumed run "
            "starts after that batch. Save after optimizer.step() (read fabric.preempted there).",
            stacklevel=4,
        )
    return loader.state_dict()  # type: ignore[attr-defined]


def draws_from_global_rng(loader: DataLoader) -> bool:
    """Whether each epoch's order comes from torch's global RNG (a shuffling sampler without a generator)."""
    from fabric.utilities._replay_sampler import _ReplaySampler

    sampler = _active_sampler(loader)
    return isinstance(sampler, _ReplaySampler) and sampler.generator is None


def is_stateful(loader: DataLoader) -> bool:
    """Whether the loader can report and restore its position inside an epoch."""
    stateful = stateful_loader_class()
    return stateful is not None and isinstance(loader, stateful)


# -- what a state describes --------------------------------------------------------------------------------------
def _order(sampler: Any) -> str:
    """How the sampler orders the data: 'shuffled', 'sequential', or its class name."""
    inner = getattr(sampler, "sampler", None)
    if isinstance(sampler, DistributedSampler) and inner is not None:  # fabric's wrapper: the wrapped one decides
        return _order(inner)
    if isinstance(sampler, DistributedSampler):
        return "shuffled" if sampler.shuffle else "sequential"
    if type(sampler).__name__ == "_ReplaySampler":
        return _order(sampler.sampler)
    if isinstance(sampler, RandomSampler):
        return "shuffled"
    if isinstance(sampler, SequentialSampler):
        return "sequential"
    return type(sampler).__name__


def _active_sampler(loader: DataLoader) -> Any:
    batch_sampler = loader.batch_sampler
    return loader.sampler if batch_sampler is None else getattr(batch_sampler, "sampler", batch_sampler)


def fingerprint(loader: DataLoader) -> dict[str, Any]:
    """What must be equal for a saved position to mean the same samples: data size, batching and order."""
    from fabric.utilities.data import sized_len

    sampler = _active_sampler(loader)
    batch_sampler = loader.batch_sampler
    return {
        "dataset_length": sized_len(loader.dataset),
        "batch_size": getattr(batch_sampler, "batch_size", loader.batch_size),
        "drop_last": getattr(batch_sampler, "drop_last", loader.drop_last),
        "order": _order(sampler),
        "seed": getattr(sampler, "seed", None) if isinstance(sampler, DistributedSampler) else None,
    }


def _describe(print_: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value}" for key, value in print_.items())


def check_fingerprint(saved: dict[str, Any], current: dict[str, Any], ignore: tuple[str, ...] = ()) -> None:
    """Refuse a state from a loader over other data, batches or order: it would silently resume the wrong samples."""
    different = {key: (saved.get(key), value) for key, value in current.items() if key not in ignore}
    different = {key: pair for key, pair in different.items() if pair[0] != pair[1]}
    if different:
        listed = "; ".join(f"{key}: saved {old!r}, now {new!r}" for key, (old, new) in different.items())
        raise FabricValueError(
            f"load(state['loader']): the saved loader state belongs to a loader that differs from this one "
            f"({listed}), so its position would point at other samples. Set the loader up as it was when saving "
            f"({_describe(saved)}), or leave the loader out of the state given to fabric.load to start its epoch "
            "from the beginning."
        )


# -- checkpoint entries ------------------------------------------------------------------------------------------
def entry(rank_states: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The checkpoint entry: every rank's state, keyed by its global rank (as text: DCP keys are strings)."""
    return {MARKER: VERSION, "world_size": world_size, "ranks": rank_states}


def collect(loader: _FabricDataLoader) -> dict[str, Any]:
    """The loader's entry for fabric.save, holding every rank's state (a collective when several ranks run).

    One rank writes a DDP checkpoint, and DCP keeps one copy of equal keys; gathering first gives each rank its
    own state back on load whatever the format.
    """
    if not is_stateful(loader.dataloader):
        return _without_position(loader)
    own = loader.state_dict()
    if loader.world_size <= 1:
        return own
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return own
    merged: dict[str, Any] = {}
    for ranks in _all_gather_small(own["ranks"]):
        merged.update(ranks)
    return entry(merged, loader.world_size)


def _without_position(loader: _FabricDataLoader) -> Any:
    """What Lightning Fabric saves for a loader that cannot report its position: its own state, else the loader.

    A loader with ``state_dict``/``load_state_dict`` of its own (litdata's StreamingDataLoader) saves that state. Any
    other is pickled whole, as Lightning does; the user asked for an exact resume by saving a set-up loader, so a
    warning (once per loader) says that the position is not in the checkpoint.
    """
    dataloader = loader.dataloader
    if has_own_state(dataloader):
        return dataloader.state_dict()  # type: ignore[attr-defined]
    if not getattr(loader, "_warned_no_position", False):
        loader._warned_no_position = True  # type: ignore[attr-defined]
        warnings.warn(
            f"save(state with a {type(dataloader).__name__} from setup_dataloaders): {_why_no_position(dataloader)}, "
            "so the loader's position in its epoch is not saved and a resumed run starts that epoch from its first "
            "batch. The DataLoader is saved whole, as Lightning Fabric saves it. For an exact mid-epoch resume, "
            f"{_fix_no_position(dataloader)}.",
            UserWarning,
            stacklevel=5,
        )
    return dataloader


def has_own_state(dataloader: DataLoader) -> bool:
    """Whether the loader saves and restores a state of its own (Lightning's test for a stateful object)."""
    return callable(getattr(dataloader, "state_dict", None)) and callable(getattr(dataloader, "load_state_dict", None))


def _why_no_position(dataloader: DataLoader) -> str:
    if stateful_loader_class() is None:
        return "torchdata is not installed"
    return f"this DataLoader subclass ({type(dataloader).__name__}) has no state_dict of its own"


def _fix_no_position(dataloader: DataLoader) -> str:
    if stateful_loader_class() is None:
        return f"install torchdata: {INSTALL}"
    return "derive it from torchdata's StatefulDataLoader instead of DataLoader, or set up a plain DataLoader"


# Bytes each rank sends in the first round: a loader state pickles to 1-3 KB on several ranks (torchdata's worker
# snapshots included), so one collective of a fixed size usually suffices.
_BUCKET = 8 * 1024
_HEADER = 8  # the payload's length


def _all_gather_small(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, in one collective when it pickles to under 8 KB.

    all_gather_object needs two collectives (the sizes, then the data) and took ~1-2 ms on 2 gloo ranks; saving
    a loader should add well under that to fabric.save. A larger object takes a second round at the largest size.
    """
    import pickle

    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    fits = len(payload) <= _BUCKET - _HEADER
    gathered = _gather_bytes(payload if fits else b"", len(payload), _BUCKET)
    lengths = [int.from_bytes(data[:_HEADER], "little") for data in gathered]
    if max(lengths) > _BUCKET - _HEADER:  # every rank sees the same lengths, so all take the second round
        gathered = _gather_bytes(payload, len(payload), max(lengths) + _HEADER)
    return [pickle.loads(data[_HEADER : _HEADER + n]) for data, n in zip(gathered, lengths, strict=True)]


def _gather_bytes(payload: bytes, length: int, size: int) -> list[bytes]:
    import torch
    import torch.distributed as dist

    data = bytearray(size)
    data[:_HEADER] = length.to_bytes(_HEADER, "little")
    data[_HEADER : _HEADER + len(payload)] = payload
    buffer = torch.frombuffer(data, dtype=torch.uint8)
    nccl = "nccl" in str(dist.get_backend()) and torch.cuda.is_available()
    if nccl:  # NCCL moves CUDA tensors only
        buffer = buffer.to(torch.device("cuda", torch.cuda.current_device()))
    gathered = [torch.empty_like(buffer) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, buffer)
    return [tensor.cpu().numpy().tobytes() for tensor in gathered]  # .cpu() is free for CPU tensors


def rank_state(saved: Any, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's state from a checkpoint entry; on another world size, only an epoch boundary carries over."""
    if not isinstance(saved, dict) or saved.get(MARKER) != VERSION or not isinstance(saved.get("ranks"), dict):
        raise FabricValueError(
            f"load(state['loader']): the checkpoint entry ({type(saved).__name__}) is not a loader state saved by "
            "fabric. Load the entry that fabric.save wrote for this loader, or leave the loader out of the state."
        )
    ranks: dict[str, Any] = saved["ranks"]
    if saved["world_size"] == world_size and str(rank) in ranks:
        return ranks[str(rank)]
    if saved["world_size"] == world_size:
        raise FabricValueError(
            f"load(state['loader']): the saved loader state holds ranks {sorted(ranks)} only, not rank {rank}. "
            "Save it with fabric.save from every rank (it gathers each rank's state), not loader.state_dict() "
            "from one rank."
        )
    mid = sorted(key for key, state in ranks.items() if state["mid_epoch"])
    if mid:
        first = ranks[mid[0]]
        raise FabricValueError(
            f"load(state['loader']): the loader state was saved by {saved['world_size']} ranks in the middle of "
            f"epoch {first['epoch']} (after {first['batches']} batches), and this run has {world_size}. The rest "
            "of that epoch was split among the saved ranks, so it cannot be divided anew. Resume on "
            f"{saved['world_size']} ranks, or save at an epoch boundary (after the loop over the loader) to change "
            "the world size."
        )
    # At a boundary every rank holds the same next epoch; the new ranks start it with their own shards.
    return {**ranks[min(ranks, key=int)], "generator": None, "global_rng": None}


def refuse_plain_loader(op: str, key: str, value: Any) -> None:
    """A DataLoader fabric did not set up has no position to save or restore; say so instead of pickling it."""
    if not isinstance(value, DataLoader) or is_stateful(value) or has_own_state(value):
        return  # a loader with a state of its own saves and loads it, as in Lightning Fabric
    if op == "save":
        raise FabricTypeError(
            f"save(state[{key!r}]={type(value).__name__}): this DataLoader was not set up by fabric, so it cannot "
            "save its position, and pickling the whole loader is not a checkpoint. Put the loader returned by "
            "fabric.setup_dataloaders(loader) in the state."
        )
    raise FabricTypeError(
        f"load(state[{key!r}]={type(value).__name__}): this DataLoader was not set up by fabric, so it cannot take "
        "a saved position. Load into the loader returned by fabric.setup_dataloaders(loader)."
    )


def load_without_position(dataloader: DataLoader, saved: Any) -> None:
    """Load into a set-up loader that cannot take a position (see _without_position for what was saved)."""
    if has_own_state(dataloader):
        dataloader.load_state_dict(saved)  # type: ignore[attr-defined]
        return
    if isinstance(saved, dict) and MARKER in saved:  # ignoring a saved position would resume at the wrong batch
        raise unsupported(dataloader, "load")
    # A loader saved whole (Lightning Fabric's way) holds no position; this loader starts its next epoch afresh.


def unsupported(loader: DataLoader, op: str = "save") -> FabricTypeError:
    """The error for a set-up loader whose position cannot be saved or restored."""
    if stateful_loader_class() is None:
        return FabricTypeError(
            f"{op}(state with a loader from setup_dataloaders): the loader's position needs torchdata's "
            f"StatefulDataLoader, and torchdata is not installed. Install it: {INSTALL}."
        )
    return FabricTypeError(
        f"{op}(state with a {type(loader).__name__} from setup_dataloaders): fabric keeps DataLoader subclasses as "
        "they are, and this one cannot report its position. Derive it from torchdata's StatefulDataLoader "
        "instead of DataLoader, or set up a plain torch.utils.data.DataLoader."
    )

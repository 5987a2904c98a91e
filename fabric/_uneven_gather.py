"""all_gather of collections whose tensors may differ in shape between processes.

Every process first sends one small int64 header, of a fixed size, describing all of its tensors at once:
how many there are, where they sit in the collection (a hash of their paths), and each one's dtype and shape.
Because the header's size never depends on the data, this exchange cannot hang, and since every process then
holds every header, a mismatch (another number of tensors, other keys, another dtype) raises the same error on
every process instead of leaving some waiting in a gather the others never start. A tensor whose shape is the
same everywhere is gathered as before (stacked on a new first dimension); any other is flattened, padded to the
largest size, gathered, and cut back into the `world_size` tensors the processes sent.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from fabric.strategies.strategy import Strategy
from fabric.utilities.apply_func import _is_namedtuple, apply_to_collection
from fabric.utilities.exceptions import FabricValueError

# Header slots per process in the first exchange: enough for a dozen or so tensors of a few dimensions. A
# process with more needs a second, larger exchange, whose size all processes read from the first one.
HEADER_SLOTS = 128
_PREFIX = 3  # needed length, number of tensors, structure hash


@dataclasses.dataclass(frozen=True)
class _TensorInfo:
    """What one process says about one of its tensors."""

    dtype_code: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n


def _stable_hash(text: str) -> int:
    """A signed 64-bit hash that is equal in every process (``hash()`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _dtype_name(code: int) -> str:
    for value in vars(torch).values():
        if isinstance(value, torch.dtype) and _stable_hash(str(value)) == code:
            return str(value)
    return f"an unknown dtype ({code})"


def tensor_paths(data: Any, path: str = "") -> Iterator[str]:
    """The location of every tensor in ``data``, in the order ``apply_to_collection`` visits them."""
    if isinstance(data, Tensor):
        yield path or "data"
    elif isinstance(data, Mapping):
        for key, item in data.items():
            yield from tensor_paths(item, f"{path}[{key!r}]")
    elif _is_namedtuple(data):
        for name, item in zip(data._fields, data, strict=True):
            yield from tensor_paths(item, f"{path}.{name}")
    elif isinstance(data, (list, tuple)):
        for index, item in enumerate(data):
            yield from tensor_paths(item, f"{path}[{index}]")
    elif dataclasses.is_dataclass(data) and not isinstance(data, type):
        for field in dataclasses.fields(data):
            if hasattr(data, field.name):
                yield from tensor_paths(getattr(data, field.name), f"{path}.{field.name}")


def pack_header(tensors: list[Tensor], paths: list[str]) -> list[int]:
    """This process's full header: [length, number of tensors, structure hash, then dtype, ndim, *shape each]."""
    body: list[int] = []
    for tensor in tensors:
        body += [_stable_hash(str(tensor.dtype)), tensor.dim(), *tensor.shape]
    return [_PREFIX + len(body), len(tensors), _stable_hash("\n".join(paths)), *body]


def unpack_header(row: list[int]) -> list[_TensorInfo]:
    """The tensor descriptions in one process's full header."""
    infos, pos = [], _PREFIX
    for _ in range(row[1]):
        ndim = row[pos + 1]
        infos.append(_TensorInfo(row[pos], tuple(row[pos + 2 : pos + 2 + ndim])))
        pos += 2 + ndim
    return infos


def _fixed_size(header: list[int], slots: int) -> list[int]:
    """The header cut or zero-padded to ``slots``; a cut one still carries its length, count and hash."""
    if len(header) > slots:
        return header[:_PREFIX] + [0] * (slots - _PREFIX)
    return header + [0] * (slots - len(header))


def _exchange(strategy: Strategy, header: list[int], slots: int, group: Any | None) -> list[list[int]] | None:
    """Every process's header (fixed to ``slots``), or None when the strategy has no processes to ask."""
    mine = torch.tensor(_fixed_size(header, slots), dtype=torch.int64, device=strategy.root_device)
    gathered = strategy.all_gather(mine, group=group)
    if gathered.dim() == 1:  # an identity gather: one process, nothing to compare
        return None
    return gathered.tolist()


def gather_headers(strategy: Strategy, header: list[int], group: Any | None) -> list[list[int]] | None:
    """Every process's full header; a second exchange only when some process's did not fit the first."""
    rows = _exchange(strategy, header, HEADER_SLOTS, group)
    if rows is None:
        return None
    longest = max(row[0] for row in rows)
    if longest > HEADER_SLOTS:  # every process reads the same rows, so all of them take this branch together
        rows = _exchange(strategy, header, longest, group)
        assert rows is not None
    return rows


def check_same_structure(rows: list[list[int]], paths: list[str], rank: int) -> list[list[_TensorInfo]]:
    """Each process's tensor descriptions; raises the same error on every process when they do not line up."""
    counts = [row[1] for row in rows]
    if len(set(counts)) > 1 or len({row[2] for row in rows}) > 1:
        per_rank = ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
        raise FabricValueError(
            f"fabric.all_gather(): the processes passed collections that do not match (tensors per rank: "
            f"{per_rank}; this is rank {rank}, with tensors at {paths or 'no path'}). Tensors are gathered by "
            "their position in the collection, so every process must pass the same keys and the same number of "
            "tensors, in the same order; only the tensors' shapes may differ. Pass the same structure everywhere."
        )
    infos = [unpack_header(row) for row in rows]
    for index, path in enumerate(paths):
        codes = [ranks[index].dtype_code for ranks in infos]
        if len(set(codes)) > 1:
            dtypes = ", ".join(f"rank {r}: {_dtype_name(c)}" for r, c in enumerate(codes))
            raise FabricValueError(
                f"fabric.all_gather(): the tensor at {path} has different dtypes on the processes ({dtypes}). "
                "A gather copies raw elements, so the dtype must be the same everywhere. Convert it first, "
                "e.g. tensor.float(), on every process."
            )
    return infos


def gather_uneven(
    strategy: Strategy, tensor: Tensor, infos: list[_TensorInfo], group: Any | None, sync_grads: bool
) -> list[Tensor]:
    """Gather a tensor whose shape differs between processes: one padded gather, then one slice per process."""
    largest = max(info.numel for info in infos)
    if largest == 0:  # all empty: nothing to send
        return [tensor.new_empty(info.shape) for info in infos]
    flat = tensor.reshape(-1)
    if flat.numel() < largest:
        flat = torch.cat([flat, flat.new_zeros(largest - flat.numel())])
    gathered = strategy.all_gather(flat, group=group, sync_grads=sync_grads)  # (world_size, largest)
    return [gathered[r, : info.numel].view(info.shape) for r, info in enumerate(infos)]


def all_gather(strategy: Strategy, data: Any, group: Any | None, sync_grads: bool) -> Any:
    """Gather every tensor in ``data``: stacked where its shape is the same everywhere, else a list per process."""
    tensors: list[Tensor] = []
    apply_to_collection(data, Tensor, tensors.append)
    paths = list(tensor_paths(data))
    rows = gather_headers(strategy, pack_header(tensors, paths), group)
    if rows is None:
        return apply_to_collection(data, Tensor, strategy.all_gather, group=group, sync_grads=sync_grads)
    infos = check_same_structure(rows, paths, strategy.global_rank)
    index = iter(range(len(tensors)))  # apply_to_collection visits the tensors in the order they were packed

    def gather(tensor: Tensor) -> Any:
        i = next(index)
        per_rank = [ranks[i] for ranks in infos]
        if len({info.shape for info in per_rank}) == 1:
            return strategy.all_gather(tensor, group=group, sync_grads=sync_grads)
        return gather_uneven(strategy, tensor, per_rank, group, sync_grads)

    return apply_to_collection(data, Tensor, gather)

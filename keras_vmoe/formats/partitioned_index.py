"""The index of a vmoe partitioned checkpoint: its leaves, shapes and chunks.

`_parse_index` turns a decoded `<prefix>.index` (V1 or legacy) into a
`CheckpointIndex` of `LeafInfo`s, without reading any data file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from keras_vmoe.formats.msgpack_ext import Box
from keras_vmoe.formats.msgpack_ext import _as_str
from keras_vmoe.formats.msgpack_ext import _FormatError
from keras_vmoe.formats.msgpack_ext import _IndexInfo
from keras_vmoe.formats.msgpack_ext import _RawBox
from keras_vmoe.formats.msgpack_ext import _resolve_dtype
from keras_vmoe.formats.urls import redact

VERSION_V1 = "20220622"

# Larger dimensions cannot be addressed with int64 (nor stored anywhere).
_MAX_DIM = 2**62
# Data files a checkpoint may have (one per host of the largest pods, and
# room to spare); a larger count is an edited index.
MAX_SHARD_COUNT = 16384


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, incomplete or malformed, or
    (a training checkpoint) written by another run.

    Raised (or a subclass) by `keras_vmoe.formats` and `keras_vmoe.training`;
    the credentials of URLs in its message are shown as `***`.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*(redact(arg) for arg in args), **kwargs)


@dataclasses.dataclass(frozen=True)
class LeafInfo:
    """Where one array of the checkpoint is stored.

    Attributes:
        leaf_id: Position in the sorted depth-first walk of the index (the key
            of its chunks in the data files).
        path: Keys from the root of the tree to the leaf.
        shape: Global shape of the array.
        dtype: numpy dtype of the array (``ml_dtypes.bfloat16`` for bfloat16).
        slices: Global slice of every stored chunk, as (start, stop) per dim.
        shards: Shard number holding each chunk (parallel to ``slices``).
    """

    leaf_id: int
    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    slices: list[Box]
    shards: list[int]

    @property
    def path_str(self) -> str:
        return "/".join(self.path)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class CheckpointIndex:
    """Content of a ``.index`` file.

    Attributes:
        version: ``'20220622'`` for V1 checkpoints, None for the legacy index.
        shard_count: Number of ``.data-NNNNN-of-NNNNN`` files.
        leaves: Every leaf, ordered by leaf id.
    """

    version: str | None
    shard_count: int
    leaves: list[LeafInfo]

    @property
    def used_shards(self) -> list[int]:
        """The sorted numbers of the data files holding the leaves' chunks."""
        return sorted({shard for leaf in self.leaves for shard in leaf.shards})

    @property
    def paths(self) -> list[str]:
        """The "/"-joined path of every leaf, in leaf-id order."""
        return [leaf.path_str for leaf in self.leaves]

    def leaf(self, path: str | Sequence[str]) -> LeafInfo:
        """Returns the LeafInfo of a "/"-joined path or a tuple of keys.

        Raises:
            KeyError: If there is no such leaf.
        """
        wanted = _path_to_str(path)
        for leaf in self.leaves:
            if leaf.path_str == wanted:
                return leaf
        raise KeyError(f"No leaf {wanted!r} in the checkpoint index.")


def index_path(prefix: str) -> str:
    return f"{prefix}.index"


def shard_path(prefix: str, shard: int, shard_count: int) -> str:
    return f"{prefix}.data-{shard:05d}-of-{shard_count:05d}"


_TRUNCATED = "{path}: the file is truncated (msgpack ran out of data)."


@contextlib.contextmanager
def _reading(path: str) -> Iterator[None]:
    """Turns decoding errors raised while reading `path` into CheckpointError."""
    try:
        yield
    except CheckpointError:
        raise
    except _FormatError as error:
        raise CheckpointError(f"{path}: {error}") from error
    except msgpack.OutOfData as error:
        raise CheckpointError(_TRUNCATED.format(path=path)) from error
    except (msgpack.UnpackException, ValueError, TypeError, OverflowError) as error:
        if "incomplete input" in str(error):  # unpackb's way to say "truncated".
            raise CheckpointError(_TRUNCATED.format(path=path)) from error
        detail = str(error) or "invalid or unsupported msgpack type byte"
        raise CheckpointError(
            f"{path}: corrupt msgpack data ({type(error).__name__}: {detail})."
        ) from error


def _path_to_str(path: str | Sequence[str]) -> str:
    return path if isinstance(path, str) else "/".join(path)


def _walk_sorted(
    tree: Mapping[Any, Any], prefix: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Yields (path, leaf) depth-first with sorted keys; None leaves are skipped."""
    bad = [key for key in tree if not isinstance(key, str)]
    if bad:
        where = "/".join(prefix) or "the root"
        raise _FormatError(f"non-string keys {bad!r} under {where}")
    for key in sorted(tree):
        value = tree[key]
        if isinstance(value, Mapping):
            yield from _walk_sorted(value, (*prefix, key))
        elif value is not None:
            yield (*prefix, key), value


def _resolve_box(raw: _RawBox, shape: tuple[int, ...]) -> Box:
    """Turns a decoded SliceNd into (start, stop) pairs checked against `shape`."""
    if len(raw) != len(shape):
        raise _FormatError(
            f"slice {raw!r} has {len(raw)} dims but the array has {len(shape)}")
    box = []
    for (start, stop), dim in zip(raw, shape, strict=True):
        start = 0 if start is None else start
        stop = dim if stop is None else stop
        if not 0 <= start <= stop <= dim:
            raise _FormatError(
                f"slice {_format_box(tuple(box) + ((start, stop),))} is out of bounds "
                f"for shape {shape}"
            )
        box.append((start, stop))
    return tuple(box)


def _format_box(box: Box) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


def _leaf_info(leaf_id: int, path: tuple[str, ...], info: Any, shard_count: int
               ) -> LeafInfo:
    where = f"leaf {leaf_id} ({'/'.join(path)})"
    if not isinstance(info, _IndexInfo):
        raise _FormatError(
            f"{where}: expected an IndexInfo (ext type 8), got {info!r:.200}")
    try:
        dtype = _resolve_dtype(info.dtype_name)
        if any(d < 0 for d in info.shape):
            raise _FormatError(f"negative dimension in shape {info.shape}")
        if any(d > _MAX_DIM for d in info.shape):
            raise _FormatError(
                f"dimension larger than {_MAX_DIM} in shape {info.shape}")
        boxes = [_resolve_box(raw, info.shape) for raw in info.slices]
    except _FormatError as error:
        raise _FormatError(f"{where}: {error}") from None
    if len(boxes) != len(info.shards):
        raise _FormatError(
            f"{where}: {len(boxes)} slices but {len(info.shards)} shard numbers")
    bad = [s for s in info.shards if not 0 <= s < shard_count]
    if bad:
        raise _FormatError(
            f"{where}: shard numbers {bad} are not in [0, {shard_count})")
    return LeafInfo(leaf_id, path, info.shape, dtype, boxes, list(info.shards))


def _parse_index(document: Any) -> CheckpointIndex:
    if not isinstance(document, dict):
        raise _FormatError("the index is not a msgpack map")
    missing = [key for key in ("index", "shard_count") if key not in document]
    if missing:
        raise _FormatError(
            f"the index has no {missing} entry (keys: {sorted(map(str, document))})")
    shard_count, tree = document["shard_count"], document["index"]
    if not isinstance(shard_count, int) or shard_count < 1:
        raise _FormatError(f"bad shard_count {shard_count!r}")
    if shard_count > MAX_SHARD_COUNT:
        raise _FormatError(f"bad shard_count {shard_count:,}: a checkpoint has at most "
                           f"{MAX_SHARD_COUNT:,} data files")
    if not isinstance(tree, dict):
        raise _FormatError("the 'index' entry is not a map")
    version = document.get("version")
    version = None if version is None else _as_str(version)
    leaves = [_leaf_info(leaf_id, path, info, shard_count)
              for leaf_id, (path, info) in enumerate(_walk_sorted(tree))]
    return CheckpointIndex(version=version, shard_count=shard_count, leaves=leaves)



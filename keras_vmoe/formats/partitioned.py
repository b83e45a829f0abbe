"""Reader and writer for vmoe's "partitioned" checkpoint format.

A checkpoint with prefix ``P`` is ``P.index`` (a msgpack map of the parameter
tree, each leaf an ``IndexInfo``: shape, dtype, and the slice and shard of each
chunk) and ``P.data-{shard:05d}-of-{shard_count:05d}`` files (msgpack maps of
leaf id -> chunks, each cut into sub-chunks). Data files are streamed, so
memory holds about one sub-chunk and the leaves being assembled.
"""

from __future__ import annotations

import itertools
import math
import types
from collections.abc import Container
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import BinaryIO

import msgpack
import numpy as np

from keras_vmoe.formats.filesystem import _atomic_write
from keras_vmoe.formats.filesystem import _fs
from keras_vmoe.formats.msgpack_ext import _EXT_SLICE_ND
from keras_vmoe.formats.msgpack_ext import Box
from keras_vmoe.formats.msgpack_ext import _dtype_name
from keras_vmoe.formats.msgpack_ext import _ext_hook
from keras_vmoe.formats.msgpack_ext import _FormatError
from keras_vmoe.formats.msgpack_ext import _index_info_ext
from keras_vmoe.formats.msgpack_ext import _little_endian
from keras_vmoe.formats.msgpack_ext import _ndarray_ext
from keras_vmoe.formats.msgpack_ext import _slice_nd_payload
from keras_vmoe.formats.partitioned_index import VERSION_V1
from keras_vmoe.formats.partitioned_index import CheckpointError
from keras_vmoe.formats.partitioned_index import CheckpointIndex
from keras_vmoe.formats.partitioned_index import LeafInfo
from keras_vmoe.formats.partitioned_index import _format_box
from keras_vmoe.formats.partitioned_index import _parse_index
from keras_vmoe.formats.partitioned_index import _path_to_str
from keras_vmoe.formats.partitioned_index import _reading
from keras_vmoe.formats.partitioned_index import _resolve_box
from keras_vmoe.formats.partitioned_index import _walk_sorted
from keras_vmoe.formats.partitioned_index import index_path
from keras_vmoe.formats.partitioned_index import shard_path
from keras_vmoe.utils.memory_budget import format_bytes

__all__ = [
    "MAGIC_KEY",
    "MAX_CHUNK_BYTES",
    "MAX_SUBCHUNK_BYTES",
    "VERSION_V1",
    "CheckpointError",
    "check_data_files",
    "CheckpointIndex",
    "LeafInfo",
    "index_path",
    "iter_leaves",
    "read_index",
    "restore_checkpoint",
    "restore_flat",
    "save_checkpoint",
    "shard_path",
]

MAGIC_KEY = "__msgpack_array_chunk_a87ca2__"
# The V1 writer splits arrays larger than this into several chunks.
MAX_CHUNK_BYTES = 256 * 2**20
# Chunks are cut into sub-chunks (ndarray ext objects) of at most this size.
# The writer reads it at call time, so tests can lower it with monkeypatch.
MAX_SUBCHUNK_BYTES = 2**30

_READ_SIZE = 4 * 2**20
# Coordinate-compressed grids up to this many cells are always counted
# exactly; larger ones only when the boxes could cover the array.
_EXACT_GRID_CELLS = 2**22


def read_index(prefix: str, check_data: bool = False) -> CheckpointIndex:
    """Reads the ``.index`` file of a checkpoint.

    Args:
        prefix: Checkpoint prefix, without ``.index`` (local path or gs://).
        check_data: Also check the data files with `check_data_files`.

    Returns:
        The parsed index; leaves are in leaf-id order.

    Raises:
        CheckpointError: If the index is missing or malformed.
    """
    path = index_path(prefix)
    fs = _fs(path)
    advice = "pass the checkpoint prefix, i.e. the path without '.index' or '.data-*'"
    if not fs.exists(path):
        raise CheckpointError(f"Checkpoint index not found: {path} ({advice}).")
    if fs.isdir(path):
        raise CheckpointError(
            f"{path} is a directory, not a checkpoint index file ({advice}).")
    with _reading(path):
        with fs.open(path, "rb") as file:
            data = file.read()
        document = msgpack.unpackb(data, raw=False, ext_hook=_ext_hook,
                                   strict_map_key=False)
        index = _parse_index(document)
    if check_data:
        check_data_files(prefix, index)
    return index


def _covered_elements(shape: tuple[int, ...], boxes: Sequence[Box]) -> int:
    """Elements of `shape` covered by the union of boxes (coordinate compression).

    When the grid is huge and the boxes hold fewer elements than the array,
    their total (an upper bound of the union) is returned without a grid.
    """
    if not shape:
        return 1 if boxes else 0
    edges = [
        np.unique(np.array([0, dim] + [b[d][i] for b in boxes for i in (0, 1)],
                           np.int64))
        for d, dim in enumerate(shape)
    ]
    cells = math.prod(len(e) - 1 for e in edges)
    if cells > _EXACT_GRID_CELLS:
        total = sum(_box_size(box) for box in boxes)
        if total < math.prod(shape):
            return total
    grid = np.zeros([len(e) - 1 for e in edges], dtype=np.uint8)
    for box in boxes:
        index = tuple(
            slice(int(np.searchsorted(e, a)), int(np.searchsorted(e, b)))
            for e, (a, b) in zip(edges, box, strict=True)
        )
        grid[index] = 1
    counts = grid
    for e in reversed(edges):
        counts = counts @ np.diff(e)
    return int(counts)


def _coverage_message(leaf: LeafInfo, covered: int) -> str:
    return (
        f"leaf {leaf.leaf_id} ({leaf.path_str}, shape {leaf.shape}) is incomplete: "
        f"{leaf.size - covered} of its {leaf.size} elements are missing"
    )


def _to_index(box: Box) -> tuple[slice, ...] | types.EllipsisType:
    return tuple(slice(a, b) for a, b in box) if box else Ellipsis


class _LeafBuffer:
    """Assembles one leaf from its chunks."""

    def __init__(self, leaf: LeafInfo) -> None:
        self.leaf = leaf
        self.array: np.ndarray | None = None
        self.boxes: list[Box] = []
        self.pending_shards = set(leaf.shards)
        self.absent_from: list[str] = []  # Listed shard files without its key.

    def add(self, raw_box: Any, parts: list[Any]) -> None:
        """Copies one chunk (its slice and its sub-chunks) into the leaf."""
        leaf = self.leaf
        where = f"leaf {leaf.leaf_id} ({leaf.path_str})"
        if not isinstance(raw_box, tuple):
            raise _FormatError(
                f"{where}: expected a SliceNd (ext type 6), got {raw_box!r:.200}")
        try:
            box = _resolve_box(raw_box, leaf.shape)
        except _FormatError as error:
            raise _FormatError(f"{where}: {error}") from None
        chunk_shape = tuple(b - a for a, b in box)
        self._check_parts(where, box, chunk_shape, parts)
        if self.array is None:
            self.array = np.empty(leaf.shape, leaf.dtype)
        dest = self.array[_to_index(box)]
        if len(parts) == 1:
            dest[...] = parts[0].reshape(chunk_shape)
        else:
            # Sub-chunk by sub-chunk: no concatenated copy of the chunk.
            flat = dest.reshape(-1) if dest.flags.c_contiguous else dest.flat
            offset = 0
            for i, part in enumerate(parts):
                flat[offset : offset + part.size] = part.reshape(-1)
                offset += part.size
                parts[i] = None  # Free each sub-chunk once copied.
        self.boxes.append(box)

    def _check_parts(self, where: str, box: Box, chunk_shape: tuple[int, ...],
                     parts: list[Any]) -> None:
        for part in parts:
            if not isinstance(part, np.ndarray):
                raise _FormatError(
                    f"{where}: sub-chunk is not an ndarray ext: {part!r:.200}")
            if _little_endian(part.dtype) != _little_endian(self.leaf.dtype):
                raise _FormatError(
                    f"{where}: chunk dtype {part.dtype} differs from the index dtype "
                    f"{self.leaf.dtype}"
                )
        total = sum(part.size for part in parts)
        if total != math.prod(chunk_shape):
            raise _FormatError(
                f"{where}: chunk for slice {_format_box(box)} (shape {chunk_shape}, "
                f"{math.prod(chunk_shape)} elements) holds {total} elements"
            )

    def finish(self, prefix: str) -> np.ndarray:
        """Returns the assembled array after checking that it is fully covered."""
        covered = _covered_elements(self.leaf.shape, self.boxes)
        if covered < self.leaf.size:
            absent = (f"; the index lists chunks in {', '.join(self.absent_from)}, "
                      "but they hold no data for it") if self.absent_from else ""
            raise CheckpointError(
                f"Checkpoint {prefix!r}: {_coverage_message(self.leaf, covered)} "
                f"(the chunks stored in the data files do not cover it{absent})."
            )
        if self.array is None:
            self.array = np.empty(self.leaf.shape, self.leaf.dtype)
        return self.array


def _read_chunks(unpacker: msgpack.Unpacker, leaf_id: int, skip: bool = False
                 ) -> Iterator[tuple[Any, list[Any]]]:
    """Yields (SliceNd, sub-chunks) for each chunk of the current leaf value.

    With `skip`, nothing is decoded (the items are None).
    """
    read = unpacker.skip if skip else unpacker.unpack
    try:
        for _ in range(unpacker.read_array_header()):
            if unpacker.read_array_header() != 2:
                raise _FormatError("malformed chunk: expected [sub-chunks, SliceNd]")
            parts = [read() for _ in range(unpacker.read_array_header())]
            yield read(), parts
    except _FormatError as error:
        if str(error).startswith("leaf "):
            raise
        raise _FormatError(f"leaf {leaf_id}: {error}") from None


def _parse_leaf_key(key: Any, num_leaves: int) -> int:
    if isinstance(key, int) and not isinstance(key, bool):
        leaf_id = key
    elif isinstance(key, str) and key.isdigit():
        leaf_id = int(key)
    else:
        raise _FormatError(f"unexpected key {key!r} (expected a leaf id)")
    if leaf_id >= num_leaves:
        raise _FormatError(f"leaf id {leaf_id} is not in the index (which has "
                           f"{num_leaves} leaves, ids 0-{num_leaves - 1})")
    return leaf_id


def _iter_shard(file: BinaryIO, num_leaves: int, wanted: Container[int]
                ) -> Iterator[tuple[int, Iterator[tuple[Any, list[Any]]]]]:
    """Streams a data shard, yielding (leaf_id, chunk iterator) for wanted leaves.

    Use each chunk iterator before advancing (the rest is drained); unwanted
    leaves are skipped without decoding.
    """
    unpacker = msgpack.Unpacker(file, raw=False, ext_hook=_ext_hook,
                                strict_map_key=False, max_buffer_size=0,
                                read_size=_READ_SIZE)
    has_magic = False
    for _ in range(unpacker.read_map_header()):
        key = unpacker.unpack()
        if key == MAGIC_KEY:
            has_magic = unpacker.unpack() is True
            continue
        leaf_id = _parse_leaf_key(key, num_leaves)
        chunks = _read_chunks(unpacker, leaf_id, skip=leaf_id not in wanted)
        if leaf_id in wanted:
            yield leaf_id, chunks
        for _ in chunks:
            pass
    if not has_magic:
        raise _FormatError(
            f"not a partitioned checkpoint data file (no {MAGIC_KEY!r}: True entry)")
    try:
        unpacker.unpack()
    except msgpack.OutOfData:
        return
    raise _FormatError("unexpected data after the end of the shard map")


def _select_leaves(index: CheckpointIndex, paths: Iterable[str | Sequence[str]] | None
                   ) -> list[LeafInfo]:
    if paths is None:
        return list(index.leaves)
    wanted = {_path_to_str(p) for p in ([paths] if isinstance(paths, str) else paths)}
    unknown = sorted(wanted - set(index.paths))
    if unknown:
        raise KeyError(f"Leaves not in the checkpoint: {unknown}")
    return [leaf for leaf in index.leaves if leaf.path_str in wanted]


def _check_shards_exist(prefix: str, index: CheckpointIndex,
                        shards: Iterable[int]) -> None:
    files = [shard_path(prefix, s, index.shard_count) for s in sorted(shards)]
    fs = _fs(index_path(prefix))
    missing = [f for f in files if not fs.exists(f)]
    if missing:
        raise CheckpointError(
            f"Checkpoint {prefix!r}: {len(missing)} data shard file(s) missing: "
            f"{', '.join(missing)}"
        )
    directories = [f for f in files if fs.isdir(f)]
    if directories:
        raise CheckpointError(
            f"Checkpoint {prefix!r}: {', '.join(directories)} is a directory, "
            "not a data shard file."
        )


def _box_size(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def _check_data_sizes(prefix: str, index: CheckpointIndex,
                      leaves: Sequence[LeafInfo]) -> None:
    """Checks the bytes the index places in each data file against its size."""
    fs = _fs(index_path(prefix))
    needed: dict[int, list[tuple[int, LeafInfo]]] = {}
    for leaf in leaves:
        per_shard: dict[int, int] = {}
        for box, shard in zip(leaf.slices, leaf.shards, strict=True):
            nbytes = _box_size(box) * leaf.dtype.itemsize
            per_shard[shard] = per_shard.get(shard, 0) + nbytes
        for shard, count in per_shard.items():
            needed.setdefault(shard, []).append((count, leaf))
    for shard in sorted(needed):
        path = shard_path(prefix, shard, index.shard_count)
        available = fs.size(path)
        why = ("The data file is truncated, or the index is corrupt or belongs to "
               "other data files.")
        for count, leaf in needed[shard]:
            if count > available:
                raise CheckpointError(
                    f"{index_path(prefix)}: leaf {leaf.leaf_id} ({leaf.path_str}) "
                    f"declares shape {leaf.shape} of {leaf.dtype}, "
                    f"{format_bytes(count)} in data file {path}, which holds "
                    f"only {format_bytes(available)}. {why}")
        total = sum(count for count, _ in needed[shard])
        if total > available:
            _, leaf = max(needed[shard], key=lambda item: item[0])
            raise CheckpointError(
                f"{index_path(prefix)}: the {len(needed[shard])} leaves the index "
                f"places in data file {path} need {format_bytes(total)} "
                f"(largest: leaf {leaf.leaf_id} ({leaf.path_str}), shape "
                f"{leaf.shape} of {leaf.dtype}), but the file holds only "
                f"{format_bytes(available)}. {why}")


def check_data_files(
    prefix: str,
    index: CheckpointIndex | None = None,
    paths: Iterable[str | Sequence[str]] | None = None,
) -> None:
    """Checks that the data files can hold what the index declares.

    Without reading any data: the chunks listed for every leaf cover it, the
    data files exist, and each is large enough for the chunks placed in it.

    Args:
        prefix: Checkpoint prefix (local path or gs://).
        index: The index of `prefix` (read if None).
        paths: Optional leaves to check (default: all).

    Raises:
        CheckpointError: Naming the file, the leaf, its declared size and
            the bytes available.
    """
    index = read_index(prefix) if index is None else index
    leaves = _select_leaves(index, paths)
    _check_shards_exist(prefix, index, {s for leaf in leaves for s in leaf.shards})
    _check_data_sizes(prefix, index, leaves)
    for leaf in leaves:
        covered = _covered_elements(leaf.shape, leaf.slices)
        if covered < leaf.size:
            raise CheckpointError(
                f"{index_path(prefix)}: {_coverage_message(leaf, covered)} "
                "(the slices listed in the index do not cover it: "
                f"{[_format_box(b) for b in leaf.slices]}).")


def _assemble_shard(prefix: str, index: CheckpointIndex, shard: int,
                    buffers: dict[int, _LeafBuffer]
                    ) -> Iterator[tuple[LeafInfo, np.ndarray]]:
    """Reads one shard into `buffers`, yielding the leaves it completes."""
    path = shard_path(prefix, shard, index.shard_count)
    expected = {i for i, buffer in buffers.items() if shard in buffer.pending_shards}
    fs = _fs(path)
    with _reading(path), fs.open(path, "rb") as file:
        for leaf_id, chunks in _iter_shard(file, len(index.leaves), buffers):
            buffer = buffers[leaf_id]
            if leaf_id not in expected:
                shards = buffer.leaf.shards
                twice = " (or the leaf appears twice)" if shard in shards else ""
                raise _FormatError(
                    f"leaf {leaf_id} ({buffer.leaf.path_str}) has data in this shard, but the "
                    f"index lists it only in shards {sorted(set(shards))}{twice}"
                )
            expected.discard(leaf_id)
            for raw_box, parts in chunks:
                buffer.add(raw_box, parts)
            yield from _finish_if_done(prefix, buffers, leaf_id, shard)
    for leaf_id in sorted(expected):  # Listed in the index but absent from the file.
        buffers[leaf_id].absent_from.append(path)
        yield from _finish_if_done(prefix, buffers, leaf_id, shard)


def _finish_if_done(prefix: str, buffers: dict[int, _LeafBuffer], leaf_id: int,
                    shard: int) -> Iterator[tuple[LeafInfo, np.ndarray]]:
    buffer = buffers[leaf_id]
    buffer.pending_shards.discard(shard)
    if not buffer.pending_shards:
        del buffers[leaf_id]
        yield buffer.leaf, buffer.finish(prefix)


def _iter_assembled(prefix: str, index: CheckpointIndex, leaves: list[LeafInfo]
                    ) -> Iterator[tuple[LeafInfo, np.ndarray]]:
    buffers = {leaf.leaf_id: _LeafBuffer(leaf) for leaf in leaves}
    for leaf_id in [i for i, b in buffers.items() if not b.pending_shards]:
        yield buffers[leaf_id].leaf, buffers.pop(leaf_id).finish(prefix)
    for shard in sorted({s for leaf in leaves for s in leaf.shards}):
        yield from _assemble_shard(prefix, index, shard, buffers)


def _open_leaves(prefix: str, paths: Iterable[str | Sequence[str]] | None
                 ) -> tuple[CheckpointIndex, Iterator[tuple[LeafInfo, np.ndarray]]]:
    """Validates the index and shard files eagerly; returns a lazy leaf iterator."""
    index = read_index(prefix)
    leaves = _select_leaves(index, paths)
    check_data_files(prefix, index, [leaf.path for leaf in leaves])
    return index, _iter_assembled(prefix, index, leaves)


def iter_leaves(prefix: str, paths: Iterable[str | Sequence[str]] | None = None
                ) -> Iterator[tuple[str, np.ndarray]]:
    """Reads a checkpoint leaf by leaf, with bounded memory.

    The index and data files are checked at the call; the data is read lazily,
    each shard once. A leaf is yielded once every shard holding part of it was
    read: in data-file order, not in the order of `paths`.

    Args:
        prefix: Checkpoint prefix (local path or gs://).
        paths: Optional leaves to read ("/"-joined strings or tuples of keys);
            the others are skipped undecoded.

    Returns:
        An iterator of ("/"-joined path, array) pairs, each leaf once.

    Raises:
        CheckpointError: For a missing, incomplete or malformed checkpoint.
        KeyError: If `paths` names leaves that are not in the checkpoint.
    """
    _, leaves = _open_leaves(prefix, paths)
    return ((leaf.path_str, array) for leaf, array in leaves)


def restore_flat(prefix: str) -> dict[str, np.ndarray]:
    """Restores a checkpoint as a dict keyed by "/"-joined path, in leaf-id order."""
    index, leaves = _open_leaves(prefix, None)
    arrays = {leaf.leaf_id: array for leaf, array in leaves}
    return {leaf.path_str: arrays[leaf.leaf_id] for leaf in index.leaves}


def restore_checkpoint(prefix: str) -> dict[str, Any]:
    """Restores a checkpoint as a nested dict of numpy arrays.

    bfloat16 arrays have dtype ``ml_dtypes.bfloat16``; scalars are 0-d arrays.
    """
    index, leaves = _open_leaves(prefix, None)
    arrays = {leaf.leaf_id: array for leaf, array in leaves}
    return _nest((leaf.path, arrays[leaf.leaf_id]) for leaf in index.leaves)


def _nest(items: Iterable[tuple[Sequence[str], Any]]) -> dict[str, Any]:
    """The nested dict holding each `(path, value)` pair."""
    tree: dict[str, Any] = {}
    for path, value in items:
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def _subchunks(chunk: np.ndarray) -> Iterator[np.ndarray]:
    """Cuts a chunk, flattened in C order, into pieces of <= MAX_SUBCHUNK_BYTES."""
    flat = np.ascontiguousarray(chunk).reshape(-1)
    step = max(1, MAX_SUBCHUNK_BYTES // max(1, flat.dtype.itemsize))
    if flat.size == 0:
        yield flat
    for start in range(0, flat.size, step):
        yield flat[start : start + step]


def _write_index(prefix: str, index: CheckpointIndex) -> None:
    """Writes the ``.index`` file of `index` (atomically)."""
    tree = _nest((leaf.path, _index_info_ext(leaf)) for leaf in index.leaves)
    document: dict[str, Any] = {"shard_count": index.shard_count, "index": tree}
    if index.version is not None:
        document["version"] = index.version
    with _atomic_write(index_path(prefix)) as file:
        file.write(msgpack.packb(document, use_bin_type=True, strict_types=True))


def _write_shard(
        path: str, entries: Sequence[tuple[int, Sequence[tuple[Box, np.ndarray]]]]
) -> None:
    """Writes one data shard (atomically), one sub-chunk at a time.

    `entries`: (leaf_id, [(global slice, whole leaf array), ...]) per leaf.
    """
    packer = msgpack.Packer(use_bin_type=True, strict_types=True)
    with _atomic_write(path) as file:
        file.write(packer.pack_map_header(len(entries) + 1))
        file.write(packer.pack(MAGIC_KEY) + packer.pack(True))
        for leaf_id, chunks in entries:
            file.write(packer.pack(str(leaf_id)))
            file.write(packer.pack_array_header(len(chunks)))
            for box, array in chunks:
                parts = list(_subchunks(array[_to_index(box)]))
                file.write(packer.pack_array_header(2))
                file.write(packer.pack_array_header(len(parts)))
                for part in parts:
                    file.write(packer.pack(_ndarray_ext(part)))
                slice_nd = msgpack.ExtType(_EXT_SLICE_ND, _slice_nd_payload(box))
                file.write(packer.pack(slice_nd))


def _normalize_box(spec: Sequence[Any], shape: tuple[int, ...], where: str) -> Box:
    """Turns a chunk spec (slices or (start, stop) pairs per dim) into a Box."""
    if len(spec) != len(shape):
        raise ValueError(f"{where}: chunk slice {spec!r} has {len(spec)} dims, "
                         f"the array has {len(shape)}")
    box = []
    for item, dim in zip(spec, shape, strict=True):
        if isinstance(item, slice):
            start, stop, step = item.indices(dim)
            if step != 1:
                raise ValueError(f"{where}: strided chunk slices are not supported")
        else:
            start, stop = (int(v) for v in item)
        if not 0 <= start <= stop <= dim:
            raise ValueError(
                f"{where}: chunk slice {spec!r} is out of bounds for shape {shape}")
        box.append((start, stop))
    return tuple(box)


def _default_boxes(array: np.ndarray, max_chunk_bytes: int) -> list[Box]:
    """Whole array, or even pieces along axis 0 if it exceeds max_chunk_bytes."""
    full = tuple((0, d) for d in array.shape)
    if array.ndim == 0 or array.nbytes <= max_chunk_bytes or array.shape[0] <= 1:
        return [full]
    pieces = min(array.shape[0], math.ceil(array.nbytes / max_chunk_bytes))
    edges = [round(i * array.shape[0] / pieces) for i in range(pieces + 1)]
    return [((a, b), *full[1:]) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def _assign_shards(where: str, n: int, given: Sequence[int] | None, num_shards: int,
                   counter: Iterator[int]) -> list[int]:
    """Shard of each of the `n` chunks of a leaf: `given`, or round-robin."""
    if given is None:
        return [next(counter) % num_shards for _ in range(n)]
    shards = [int(s) for s in given]
    if len(shards) != n or not all(0 <= s < num_shards for s in shards):
        raise ValueError(
            f"chunk_shards for {where}: need {n} shards in [0, {num_shards}), got {shards}"
        )
    return shards


def save_checkpoint(
    prefix: str,
    tree: Mapping[str, Any],
    num_shards: int = 1,
    version: str | None = VERSION_V1,
    max_chunk_bytes: int = MAX_CHUNK_BYTES,
    chunk_slices: Mapping[str, Sequence[Sequence[Any]]] | None = None,
    chunk_shards: Mapping[str, Sequence[int]] | None = None,
) -> CheckpointIndex:
    """Writes `tree` as a partitioned checkpoint (the format vmoe reads).

    Data shards are written first and the index last, each renamed into
    place, so an existing index always refers to complete data.

    Args:
        prefix: Checkpoint prefix (local path or gs://).
        tree: Nested mapping with string keys and array-like leaves (None
            leaves are skipped).
        num_shards: Number of data files.
        version: Index version; None writes the legacy, unversioned index.
        max_chunk_bytes: Arrays larger than this are split along axis 0 into
            several chunks (unless `chunk_slices` says otherwise).
        chunk_slices: Optional "/"-joined path -> list of chunks, each a
            sequence with one `slice` or (start, stop) pair per dimension
            (``()`` for scalars). The chunks must cover the whole array.
        chunk_shards: Optional "/"-joined path -> shard of each chunk. By
            default chunks are dealt to shards round-robin, over all leaves.

    Returns:
        The index that was written.

    Raises:
        ValueError: For bad arguments (unsupported dtype, bad slices...).
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    chunk_slices, chunk_shards = dict(chunk_slices or {}), dict(chunk_shards or {})
    try:
        leaves = [(path, np.asarray(value)) for path, value in _walk_sorted(tree)]
    except _FormatError as error:
        raise ValueError(f"Cannot save tree: {error}") from None
    named = set(chunk_slices) | set(chunk_shards)
    unknown = sorted(named - {"/".join(p) for p, _ in leaves})
    if unknown:
        raise ValueError(f"chunk_slices/chunk_shards name unknown leaves: {unknown}")
    counter = itertools.count()
    infos = []
    for leaf_id, (path, array) in enumerate(leaves):
        where = "/".join(path)
        specs = chunk_slices.get(where)
        boxes = ([_normalize_box(s, array.shape, where) for s in specs]
                 if specs is not None else _default_boxes(array, max_chunk_bytes))
        shards = _assign_shards(where, len(boxes), chunk_shards.get(where), num_shards,
                                counter)
        leaf = LeafInfo(leaf_id, path, array.shape, np.dtype(array.dtype), boxes,
                        shards)
        _dtype_name(leaf.dtype)  # raises for a dtype the format cannot hold
        covered = _covered_elements(leaf.shape, boxes)
        if covered < leaf.size:
            raise ValueError(
                f"chunk_slices for {leaf.path_str}: {_coverage_message(leaf, covered)}")
        infos.append(leaf)
    for shard in range(num_shards):
        entries = [
            (info.leaf_id, [(b, array) for b, s in zip(info.slices, info.shards,
                                                       strict=True) if s == shard])
            for info, (_, array) in zip(infos, leaves, strict=True)
            if shard in info.shards
        ]
        _write_shard(shard_path(prefix, shard, num_shards), entries)
    index = CheckpointIndex(version=version, shard_count=num_shards, leaves=infos)
    _write_index(prefix, index)
    return index

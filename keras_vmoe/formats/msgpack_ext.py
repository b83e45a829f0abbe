"""The msgpack extension types of vmoe's partitioned checkpoints.

Decoding (`_ext_hook`) and encoding. Malformed content raises `_FormatError`,
which the readers turn into a `CheckpointError` naming the file.
"""

from __future__ import annotations

import functools
import math
from typing import Any
from typing import NamedTuple

import ml_dtypes
import msgpack
import numpy as np

# Bytes read to decode an ndarray payload's header (shape, dtype).
_HEADER_PROBE_BYTES = 512
_EXT_NDARRAY = 1
_EXT_COMPLEX = 2
_EXT_NUMPY_SCALAR = 3
_EXT_SHAPED_ARRAY = 4
_EXT_SLICE = 5
_EXT_SLICE_ND = 6
_EXT_INDEX_INFO = 8

# One (start, stop) pair per dimension; () for scalars.
Box = tuple[tuple[int, int], ...]

# As decoded from a SliceNd: one (start, stop) per dimension, None = open end.
_RawBox = tuple[tuple[int | None, int | None], ...]


class _FormatError(ValueError):
    """Malformed content; re-raised as CheckpointError naming the file."""


class _ShapedArray(NamedTuple):
    shape: tuple[int, ...]
    dtype_name: str


class _IndexInfo(NamedTuple):
    shape: tuple[int, ...]
    dtype_name: str
    slices: list[_RawBox]
    shards: list[int]


def _as_str(value: Any) -> str:
    """Decodes a msgpack string that may arrive as bytes (raw=True)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, str):
        return value
    raise _FormatError(f"expected a string, got {value!r}")


@functools.lru_cache(maxsize=64)
def _resolve_dtype(name: str) -> np.dtype:
    """Returns the numpy dtype named `name` (including ml_dtypes types)."""
    special = getattr(ml_dtypes, name, None)
    if isinstance(special, type) and issubclass(special, np.generic):
        return np.dtype(special)
    try:
        dtype = np.dtype(name)
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in "biufc" or dtype.shape:
        raise _FormatError(f"dtype not understood: {name!r}")
    return dtype


def _little_endian(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("<")


def _unpack_payload(data: bytes, what: str, length: int | None = None) -> Any:
    """Unpacks an ext payload (a msgpack document, strings as bytes)."""
    fields = msgpack.unpackb(data, raw=True, use_list=True)
    if length is not None and (not isinstance(fields, list) or len(fields) < length):
        raise _FormatError(f"malformed {what} payload: {fields!r:.200}")
    return fields


def _inner_payload(item: Any, code: int, what: str) -> bytes:
    """Returns the payload of a nested item: a plain bin or an ext of `code`."""
    if isinstance(item, msgpack.ExtType) and item.code == code:
        return item.data
    if isinstance(item, bytes):
        return item
    raise _FormatError(f"malformed {what}: expected a bin, got {item!r:.200}")


def _decode_slice(data: bytes) -> tuple[int | None, int | None]:
    start, stop, step = _unpack_payload(data, "Slice", 3)[:3]
    if step not in (None, 1):
        raise _FormatError(f"strided slices are not supported (step={step!r})")
    for value in (start, stop):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise _FormatError(f"bad slice bound {value!r}")
    return start, stop


def _decode_slice_nd(data: bytes) -> _RawBox:
    items = _unpack_payload(data, "SliceNd")
    if not isinstance(items, list):
        raise _FormatError(f"malformed SliceNd payload: {items!r:.200}")
    return tuple(_decode_slice(_inner_payload(i, _EXT_SLICE, "Slice")) for i in items)


def _decode_shaped_array(data: bytes) -> _ShapedArray:
    shape, dtype_name = _unpack_payload(data, "ShapedArray", 2)[:2]
    if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
        raise _FormatError(f"malformed ShapedArray shape {shape!r}")
    return _ShapedArray(tuple(shape), _as_str(dtype_name))


def _decode_index_info(data: bytes) -> _IndexInfo:
    shaped, slices, shards = _unpack_payload(data, "IndexInfo", 3)[:3]
    shaped = _decode_shaped_array(
        _inner_payload(shaped, _EXT_SHAPED_ARRAY, "IndexInfo"))
    if not isinstance(slices, list) or not isinstance(shards, list):
        raise _FormatError("malformed IndexInfo: slices and shards must be lists")
    boxes = [_decode_slice_nd(_inner_payload(s, _EXT_SLICE_ND, "SliceNd"))
             for s in slices]
    if not all(isinstance(s, int) for s in shards):
        raise _FormatError(f"malformed IndexInfo shards {shards!r}")
    return _IndexInfo(shaped.shape, shaped.dtype_name, boxes, list(shards))


def _split_ndarray_payload(data: bytes) -> tuple[Any, Any, memoryview | bytes]:
    """(shape, dtype name, raw bytes) of an ndarray payload, zero-copy if usual."""
    unpacker = msgpack.Unpacker(raw=True)
    unpacker.feed(data[:_HEADER_PROBE_BYTES])
    try:
        count = unpacker.read_array_header()
        shape = unpacker.unpack()
        name = unpacker.unpack()
        pos = unpacker.tell()
    except (msgpack.OutOfData, ValueError):
        count, pos = -1, len(data)
    if count == 3 and pos < len(data):
        marker = data[pos]
        width = {0xC4: 1, 0xC5: 2, 0xC6: 4}.get(marker, 0)
        if width and pos + 1 + width <= len(data):
            size = int.from_bytes(data[pos + 1 : pos + 1 + width], "big")
            start = pos + 1 + width
            if start + size == len(data):
                return shape, name, memoryview(data)[start:]
    fields = _unpack_payload(data, "ndarray", 3)
    if len(fields) != 3 or not isinstance(fields[2], bytes):
        raise _FormatError(f"malformed ndarray payload: {fields!r:.200}")
    return fields[0], fields[1], fields[2]


def _decode_ndarray(data: bytes) -> np.ndarray:
    shape, name, buffer = _split_ndarray_payload(data)
    if not isinstance(shape, list) or not all(
            isinstance(d, int) and d >= 0 for d in shape):
        raise _FormatError(f"malformed ndarray shape {shape!r}")
    dtype = _resolve_dtype(_as_str(name))
    count = math.prod(shape)
    if count * dtype.itemsize != len(buffer):
        raise _FormatError(
            f"ndarray payload has {len(buffer)} bytes, but shape {tuple(shape)} "
            f"of {dtype} needs {count * dtype.itemsize}"
        )
    if count == 0:
        return np.empty(shape, dtype)
    array = np.frombuffer(buffer, dtype=_little_endian(dtype), count=count)
    return array.reshape(shape)


def _ext_hook(code: int, data: bytes) -> Any:
    """msgpack ext_hook decoding every ext type of the format."""
    if code in (_EXT_NDARRAY, _EXT_NUMPY_SCALAR):
        return _decode_ndarray(data)
    if code == _EXT_COMPLEX:
        real, imag = _unpack_payload(data, "complex", 2)[:2]
        return complex(real, imag)
    if code == _EXT_SHAPED_ARRAY:
        return _decode_shaped_array(data)
    if code == _EXT_SLICE:
        return _decode_slice(data)
    if code == _EXT_SLICE_ND:
        return _decode_slice_nd(data)
    if code == _EXT_INDEX_INFO:
        return _decode_index_info(data)
    raise _FormatError(f"unsupported msgpack ext type code {code}")


def _packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _dtype_name(dtype: np.dtype) -> str:
    """Name written for a dtype; checked to be readable by `_resolve_dtype`."""
    try:
        if _resolve_dtype(dtype.name) == _little_endian(dtype).newbyteorder("="):
            return dtype.name
    except _FormatError:
        pass
    raise ValueError(f"Unsupported dtype for a checkpoint leaf: {dtype}")


def _slice_nd_payload(box: Box) -> bytes:
    return _packb([_packb([start, stop, None]) for start, stop in box])


def _ndarray_ext(array: np.ndarray) -> msgpack.ExtType:
    code = _EXT_NUMPY_SCALAR if array.ndim == 0 else _EXT_NDARRAY
    array = np.ascontiguousarray(array, dtype=_little_endian(array.dtype))
    payload = _packb([list(array.shape), _dtype_name(array.dtype), array.tobytes()])
    return msgpack.ExtType(code, payload)


def _index_info_ext(leaf: Any) -> msgpack.ExtType:
    shaped = _packb([list(leaf.shape), _dtype_name(leaf.dtype), False, {}])
    slices = [_slice_nd_payload(box) for box in leaf.slices]
    return msgpack.ExtType(_EXT_INDEX_INFO, _packb([shaped, slices, list(leaf.shards)]))

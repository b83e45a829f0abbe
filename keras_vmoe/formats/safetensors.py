"""The safetensors format in NumPy alone: no torch, no TensorFlow.

A file is an 8-byte little-endian header length `n`, an `n`-byte JSON header
(`{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}`) and the
raw little-endian tensor bytes. `load` memory-maps the file.
"""

import json
import mmap
import os

import ml_dtypes
import numpy as np

# The header may not be larger than this (the reference reader's limit).
MAX_HEADER_BYTES = 100 * 2**20
DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("bool"),
}


class SafetensorsError(ValueError):
    """A file is not a readable safetensors file (the message says why)."""


def read_header(path):
    """`(header, data_start)` of a safetensors file.

    Args:
        path: the file.

    Returns:
        The JSON header (with any `"__metadata__"`) and the data's byte offset.

    Raises:
        SafetensorsError: a short file, bad header length or non-object header.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise SafetensorsError(f"{path}: {size} bytes, too short for a "
                                   "safetensors file (no 8-byte header length).")
        length = int.from_bytes(prefix, "little")
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise SafetensorsError(
                f"{path}: the header length {length} is larger than the file "
                f"({size} bytes) or than {MAX_HEADER_BYTES} bytes: not a "
                "safetensors file, or a truncated one.")
        text = file.read(length)
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, ValueError) as error:
        raise SafetensorsError(f"{path}: the header is not JSON ({error}).") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the header is not a JSON object.")
    return header, 8 + length


def _tensor_view(path, name, entry, buffer, data_start):
    """One tensor of the mapped file as a read-only NumPy array."""
    try:
        dtype = DTYPES[entry["dtype"]]
        shape = tuple(int(n) for n in entry["shape"])
        begin, end = (int(n) for n in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise SafetensorsError(
            f"{path}: tensor {name!r} has an unreadable header entry {entry!r} "
            f"(dtypes this reader knows: {sorted(DTYPES)}).") from None
    count = int(np.prod(shape, dtype=np.int64))
    if end - begin != count * dtype.itemsize or begin < 0 or (
            data_start + end > len(buffer)):
        raise SafetensorsError(
            f"{path}: tensor {name!r} ({entry['dtype']} {list(shape)}) has "
            f"offsets {begin}..{end} that do not fit its size or the file "
            f"({len(buffer)} bytes): the file is truncated or corrupt.")
    array = np.frombuffer(buffer, dtype=dtype, count=count,
                          offset=data_start + begin)
    return array.reshape(shape)


def load(path, names=None):
    """The tensors of a safetensors file as read-only NumPy views of its map.

    Args:
        path: the file.
        names: optional iterable of tensor names to return (default: all).

    Returns:
        `{name: np.ndarray}`.
    """
    header, data_start = read_header(path)
    header.pop("__metadata__", None)
    wanted = header if names is None else {n: header[n] for n in names}
    with open(path, "rb") as file:
        if os.path.getsize(path) == 0:
            raise SafetensorsError(f"{path}: the file is empty.")
        buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    return {name: _tensor_view(path, name, entry, buffer, data_start)
            for name, entry in wanted.items()}


def save(path, tensors, metadata=None):
    """Writes `{name: array}` as a safetensors file (tensors in name order).

    Args:
        path: the file to write.
        tensors: dict of NumPy arrays (or values `np.asarray` takes).
        metadata: optional dict of strings, the header's `__metadata__`.

    Returns:
        `path`.
    """
    header, chunks, offset = {}, [], 0
    for name in sorted(tensors):
        array = np.ascontiguousarray(np.asarray(tensors[name]))
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        kind = next((k for k, dtype in DTYPES.items() if dtype == array.dtype), None)
        if kind is None:
            raise ValueError(f"Tensor {name!r} has dtype {array.dtype}, which "
                             f"safetensors does not store (valid: {sorted(DTYPES)}).")
        data = array.tobytes()
        header[name] = {"dtype": kind, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # tensors start 8-byte aligned
    with open(path, "wb") as file:
        file.write(len(text).to_bytes(8, "little"))
        file.write(text)
        for data in chunks:
            file.write(data)
    return path
